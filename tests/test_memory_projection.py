"""The memory projection (``launch/bench/memory_projection.py``): dense model state per ZeRO stage against the
ZeRO paper's formulas, DRAGONN's bytes against the stated budget (``launch.bench.memory_budget.budget``), the fits, and
the command line. Fast: no processes."""
from __future__ import annotations

import json

import pytest
import torch

from launch.bench.memory_budget import budget
from launch.bench import memory_projection as mp


@pytest.mark.parametrize("world", [1, 3, 16])
def test_dense_model_state_is_16_bytes_partitioned_as_zero_partitions_it(world):
    # ZeRO paper, Sec. 3: 2 + 2 + K (K = 12) bytes; stage 1 partitions K, stage 2 K + gradients, stage 3 all
    assert mp.dense_bytes_per_param(0, world) == 16
    assert mp.dense_bytes_per_param(1, world) == pytest.approx(4 + 12 / world)
    assert mp.dense_bytes_per_param(2, world) == pytest.approx(2 + 14 / world)
    assert mp.dense_bytes_per_param(3, world) == pytest.approx(16 / world)
    with pytest.raises(ValueError, match="stage"):
        mp.dense_bytes_per_param(4, world)


def test_dragonn_bytes_are_the_stated_budget_summed():
    for stage in range(4):
        for per_node in (1, 8):
            for mode in ("gradient", "momentum"):
                exchange = "reduce_scatter" if stage and per_node == 1 else "allgather"
                want = sum(budget(mode, torch.bfloat16, False, stage=stage, world=16, per_node=per_node,
                                  exchange=exchange).values())
                assert mp.dragonn_bytes_per_param(mode, stage, 16, per_node) == pytest.approx(want)
    # the design.md totals: flat ZeRO 0 in bf16, the default (no working copies): 4 (gradient) and 8 (momentum)
    assert mp.dragonn_bytes_per_param("gradient", 0, 2, 1) == 4
    assert mp.dragonn_bytes_per_param("momentum", 0, 2, 1) == 8
    # node-aware state shrinks with the ranks per node; the step transaction adds the working copies
    assert mp.dragonn_bytes_per_param("gradient", 3, 16, 8) < mp.dragonn_bytes_per_param("gradient", 3, 16, 1)
    assert mp.dragonn_bytes_per_param("momentum", 0, 2, 1, txn=True) == 16


def test_rows_are_consistent_and_a_model_that_fits_fits():
    rows = mp.project(7e9, 2, 8)
    assert {(r["stage"], r["layout"], r["mode"]) for r in rows} == {
        (s, l, m) for s in range(4) for l in ("flat", "node") for m in ("gradient", "momentum")}
    for r in rows:
        assert r["total_GB"] == pytest.approx(r["dense_GB"] + r["dragonn_GB"])
        for cap_name, cap in mp.CAPACITIES_GB.items():
            n = r[f"fits_dragonn_{cap_name}"]
            assert n * (r["dense_B_per_param"] + r["dragonn_B_per_param"]) == pytest.approx(cap * 1e9)
            assert n <= r[f"fits_dense_{cap_name}"]
    # one node: no node-aware rows
    assert {r["layout"] for r in mp.project(1e9, 1, 8)} == {"flat"}


def test_command_line_writes_json_and_png_and_refuses_bad_sizes(tmp_path, capsys):
    out = mp.main(["--params", "1.3e9", "--nodes", "1", "--gpus-per-node", "8", "--out", str(tmp_path)])
    assert list(out) == ["1.3B on 1 x 8"]
    data = json.loads((tmp_path / "memory_projection.json").read_text())
    assert data["txn"] is False and "activations" in data["assumptions"]  # bf16's default: no working copies
    assert (tmp_path / "memory_projection.png").stat().st_size > 0
    assert "largest, H100 80 GB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mp.main(["--params", "0"])
