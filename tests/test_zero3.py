"""ZeRO stage 3 (``ds_dragonn/engine/stage3.py``): the compressed reduce-scatter against DeepSpeed's dense one
(density 1.0 bit for bit at 2 ranks, within float rounding at 3), ranks in sync in fp32, bf16 with gradient
accumulation, overlap_comm on and off, the layout of ``reduce_scatter_coalesced``, bytes, and exact resume."""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.engine.stage3 import check_zero3_hook_point, rank_major
from tests.multiproc import load_rank_files, run_ranks
from tests.zero3_cases import RUNS


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def z3(tmp_path_factory, request):
    world = request.param
    out = tmp_path_factory.mktemp(f"z3_{world}")
    run_ranks("tests.zero3_cases:runs", world, out, timeout=600)
    return world, load_rank_files(out, "z3", world)


def test_the_installed_deepspeed_has_the_hook_point():
    check_zero3_hook_point()


class _Changed:
    """A stand-in for a DeepSpeed whose ``__avg_scatter_grads`` reduces some other way."""
    def _DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads(self):
        pass

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self):
        pass


def test_a_changed_hook_point_fails_loudly():
    with pytest.raises(RuntimeError, match="changed .*reduce_and_partition_ipg_grads"):
        check_zero3_hook_point(_Changed)


@pytest.mark.parametrize("numels, world", [([5, 1, 7], 3), ([1], 2), ([4, 4], 2), ([2], 3)])
def test_rank_major_is_reduce_scatter_coalesced_layout(numels, world):
    """Rank r's block is chunk r (``ceil(numel / P)`` elements, zero-padded) of every gradient, in order; with
    sizes below the world size and not divisible by it."""
    grads = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(numels)]
    flat, per, chunks = rank_major(grads, world, torch.float64)
    assert chunks == [-(-n // world) for n in numels] and per == sum(chunks) and flat.dtype == torch.float64
    expect = []
    for r in range(world):
        for g, c in zip(grads, chunks):
            part = g[r * c:(r + 1) * c].double()
            expect += part.tolist() + [0.0] * (c - part.numel())
    assert flat.tolist() == expect


def test_density_one_is_deepspeeds_zero3(z3):
    world, runs = z3
    for r in runs:
        for a, b in zip(r["d1"]["params"], r["dense"]["params"]):
            if world == 2:  # the same sums in the same order
                assert torch.equal(a, b)
            else:  # a division by 3 before or after: float rounding
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", [n for n in RUNS if n != "dense"])
def test_ranks_stay_in_sync_and_compress(z3, name):
    world, runs = z3
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r[name]["params"], runs[0][name]["params"]))
    t = runs[0][name]["telemetry"]
    assert t["compressed_reductions"] > 0 and t["dense_reductions"] > 0  # the warm-up is DeepSpeed's own
    if name != "d1":
        assert runs[0][name]["residual_mass"] > 0  # error feedback holds what was not sent


def test_overlap_comm_does_not_change_the_result(z3):
    _, runs = z3
    for r in runs:
        assert all(torch.equal(a, b) for a, b in zip(r["sparse_overlap"]["params"], r["sparse_no_overlap"]["params"]))


def test_resume_is_exact_zero_to_fp32_consolidates_and_bytes_are_a_few_percent_of_dense(tmp_path):
    run_ranks("tests.zero3_cases:resume_runs", 2, tmp_path, timeout=600)
    for r in load_rank_files(tmp_path, "z3resume", 2):
        assert r["notes"] == [], r["notes"]
        assert r["mass"] > 0 and r["loaded_mass"] == pytest.approx(r["mass"], rel=1e-12)
        assert all(torch.equal(a, b) for a, b in zip(r["params"], r["resumed"]))
        assert len(r["consolidated"]) == len(r["at_k"])  # zero_to_fp32 consolidates the weights saved at K
        assert all(torch.equal(a, b.reshape(a.shape)) for a, b in zip(r["at_k"], r["consolidated"]))
        sent, dense = r["bytes"]
        # density 0.01, fp32: 8-byte pairs (index, value) against DeepSpeed's (P-1)/P x 4 bytes per element
        assert 0 < sent <= 0.05 * dense, (sent, dense)


def test_hpz_runs_with_the_hook_flat_and_node_aware(tmp_path):
    """ZeRO-3 with hpZ (``zero_hpz_partition_size`` 2: a second parameter partition per node of 2 ranks), 4 ranks
    as 2 nodes of 2: the gradient reduce-scatter goes through the hook, flat and node-aware; density 1.0 equals
    the dense run within float rounding (the ranks' sums in another order), ranks in sync."""
    run_ranks("tests.zero3_cases:hpz_runs", 4, tmp_path, timeout=600)
    runs = load_rank_files(tmp_path, "z3hpz", 4)
    for name in ("d1", "sparse", "node", "node_d1"):
        assert runs[0][name]["telemetry"]["compressed_reductions"] > 0
        assert runs[0][name]["layout"] == ("2 nodes x 2 ranks" if name.startswith("node") else "flat")
        for r in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r[name]["params"], runs[0][name]["params"]))
    for r in runs:
        for d1 in ("d1", "node_d1"):
            for a, b in zip(r[d1]["params"], r["dense"]["params"]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
