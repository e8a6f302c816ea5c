"""Time to target on two nodes (launch/bench_nodes_ttq.py) on synthetic records, and the configs the two-node
benchmark (launch/bench_nodes.py --task lm) and the quality sweep (launch/convergence.py's DeepSpeed runs) write.
Fast: no processes, no timing asserted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "launch"))
import bench_nodes  # noqa: E402
import bench_nodes_ttq as nt  # noqa: E402
import convergence  # noqa: E402


def record(run, losses, seed=1, density=1.0, warmup=None, every=100):
    return {"task": "lm", "run": run, "seed": seed, "steps": every * len(losses), "density": density,
            "warmup": warmup, "value": losses[-1],
            "history": [{"step": every * (i + 1), "value": v} for i, v in enumerate(losses)]}


def timing(link, **ms):
    return [{"link": link, "mode": m, "ms_per_step": v, "inter_node_mb_per_step_per_node": 0.1} for m, v in ms.items()]


def test_target_from_reference_and_seconds_by_hand():
    # reference dense_fp32 over 1000 steps: the target is its loss at step 800 = 2.0
    ref = record("dense_fp32", [10, 9, 8, 7, 6, 5, 4, 2.0, 1.5, 1.0])
    flat = record("flat_0.01", [10, 9, 8, 7, 6, 5, 4, 3, 2.0, 1.0], density=0.01,
                  warmup={"warmup_steps": 100, "density_warmup_steps": 0, "density_warmup_start": 0.25})
    curves = nt.mean_curves([ref, flat])
    result = nt.build_rows(curves, timing("100mbit", dense_fp32=80.0, dense_bf16=40.0, dragonn_flat=20.0))
    assert result["target_loss"] == pytest.approx(2.0)
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"dense_fp32", "dragonn_flat"}  # dense_bf16 has no quality run ("dense") here
    assert rows["dense_fp32"]["steps_to_target"] == pytest.approx(800)
    assert rows["dense_fp32"]["seconds_to_target"] == pytest.approx(800 * 0.080)
    r = rows["dragonn_flat"]
    assert r["steps_to_target"] == pytest.approx(900)
    # 100 warm-up steps and 8 refreshes (steps 199, 299, ..., 899) at the dense bf16 step, the rest at 20 ms
    dense = 100 + 8
    assert r["seconds_to_target"] == pytest.approx((dense * 40.0 + (900 - dense) * 20.0) / 1e3)


def test_means_over_seeds_not_reached_and_missing_reference():
    a = record("dense", [4, 3, 2, 1], seed=1)
    b = record("dense", [4, 3, 2, 3], seed=2)  # mean final 2.0
    slow = record("diloco_node", [9, 9, 9, 9], warmup={"warmup_steps": 100, "density_warmup_steps": 0})
    curves = nt.mean_curves([a, b, slow])
    assert curves["dense"]["seeds"] == [1, 2]
    assert curves["dense"]["final"] == pytest.approx(2.0)
    result = nt.build_rows(curves, timing("1gbit", dense_bf16=10.0, hier_bf16=9.0, diloco_node=5.0))
    rows = {r["mode"]: r for r in result["rows"]}
    assert rows["hier_bf16"]["quality_run"] == "dense"  # no hier_bf16 run: dense's curve stands in
    assert rows["diloco_node"]["steps_to_target"] is None and rows["diloco_node"]["seconds_to_target"] is None
    assert rows["diloco_node"]["final_gap_pct"] > 0
    assert "not reached" in nt.format_table(result)
    with pytest.raises(SystemExit, match="no reference"):
        nt.build_rows(nt.mean_curves([slow]), timing("1gbit", diloco_node=5.0))


def test_refreshes_charged_in_the_momentum_mode_only():
    warm = {"warmup_steps": 100, "density_warmup_steps": 300, "density_warmup_start": 0.25}
    assert nt.charges(record("zero3_hpz_0.01", [1.0], density=0.01, warmup=warm))["refresh_steps"] == 100
    assert nt.charges(record("zero3_hpz_gradient_0.01", [1.0], density=0.01, warmup=warm))["refresh_steps"] == 0
    assert nt.charges(record("diloco_node", [1.0], density=1.0, warmup=warm))["refresh_steps"] == 0
    assert nt.charges(record("node_0.01", [1.0], density=0.01, warmup={"warmup_steps": 100}))["refresh_steps"] == 100
    assert nt.charges(record("dense", [1.0])) == {"dense_steps": 0, "refresh_steps": 0, "density_warmup": None}


def test_bench_nodes_lm_configs(tmp_path):
    def cfg(mode):
        return json.loads(bench_nodes.config(mode, tmp_path, "lm").read_text())
    assert cfg("dense_fp32")["communication_data_type"] == "fp32" and "dragonn" not in cfg("dense_fp32")
    assert cfg("dense_bf16")["communication_data_type"] == "bf16"
    node = cfg("dragonn_node")
    assert "communication_data_type" not in node
    assert node["dragonn"]["hierarchy"] == "node" and node["dragonn"]["warmup_steps"] == 0
    assert node["dragonn"]["density_warmup_steps"] == 0 and "compress" not in node["dragonn"]  # auto, as trained
    assert cfg("diloco_node")["dragonn"]["local_steps"] == 30
    z3 = cfg("zero3_hpz_dragonn")
    assert z3["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 2, **bench_nodes.ZERO3_GATHERS}
    assert "communication_data_type" not in z3
    # the classifier's configs are as before the LM task
    assert json.loads(bench_nodes.config("diloco_flat", tmp_path).read_text())["dragonn"]["local_steps"] == 10
    assert "communication_data_type" not in json.loads(bench_nodes.config("dense_fp32", tmp_path).read_text())


def test_convergence_runs_with_deepspeed_keys(tmp_path):
    z3 = json.loads(convergence.write_config("lm", "zero3_hpz_0.01", 100, tmp_path).read_text())
    assert z3["zero_optimization"]["zero_hpz_partition_size"] == 2 and z3["dragonn"]["hierarchy"] == "flat"
    fp32 = json.loads(convergence.write_config("lm", "dense_fp32", 100, tmp_path).read_text())
    assert fp32["communication_data_type"] == "fp32" and "dragonn" not in fp32
    assert convergence.DS_RUNS["hier_bf16"][2] == ["--hier-dense", "bf16"]
    assert {run for runs, _ in nt.MODE_RUN.values() for run in runs} <= set(convergence.RUNS)


def test_command_line_refuses_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit):
        nt.main(["--quality", str(bad), "--timing", str(bad), "--out", str(tmp_path)])
    assert "bad.json: not launch/convergence.py's convergence.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        nt.main(["--quality", str(bad), "--timing", str(bad), "--out", str(tmp_path), "--target-fraction", "0"])
    assert "--target-fraction must be in (0, 1]" in capsys.readouterr().err
