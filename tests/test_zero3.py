"""ZeRO stage 3 (``ds_dragonn/engine/stage3.py``): the compressed reduce-scatter against DeepSpeed's dense one
(density 1.0 bit for bit at 2 ranks, within float rounding at 3), ranks in sync in fp32, bf16 with gradient
accumulation, overlap_comm on and off, the layout of ``reduce_scatter_coalesced``, bytes, and exact resume; at
density 1.0 with clipping and with bf16 accumulation bit for bit; DeepSpeed's own ZeRO-3 checkpoints both ways
(zero_to_fp32 included); the float64 nothing-lost invariant of the hook with awkward sizes; refusals by key.
The momentum mode: density 1.0 against the ZeRO-2 momentum run, ranks in sync (fp32, bf16 with accumulation,
``auto``), nothing lost in float64, resume exact."""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.engine.stage3 import check_zero3_hook_point, chunk_lengths, rank_major
from tests.multiproc import ranks_fixture
from tests.zero3_cases import CLIP, RUNS

#: the launch the longer 2-rank cases of this file share (tests/multiproc.py: pools); the short runs below and hpZ's
#: 4 ranks go with the other files' cases of their sizes ("gloo")
POOL = "zero"
z3 = ranks_fixture("tests.zero3_cases:runs", "z3", timeout=600, worlds=[2, 3], ids=["2ranks", "3ranks"], pool="gloo")


@pytest.mark.parametrize("extra, key", [({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}},
                                         "'zero_optimization.zenflow'"),
                                        ({"gradient_predivide_factor": 2.0}, "'gradient_predivide_factor'"),
                                        ({"zero_optimization": {"stage": 3, "cpu_offload": True}},
                                         "'zero_optimization.cpu_offload'"),
                                        ({"zero_optimization": {"stage": 3, "cpu_offload_param": True}},
                                         "'zero_optimization.cpu_offload_param'")])
def test_zero3_refuses_what_the_hook_does_not_reproduce_naming_the_key(extra, key):
    """Besides tests/test_config.py's (offload, qgZ, reduce_scatter false)."""
    import ds_dragonn
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3}, "dragonn": {"enabled": True}, **extra}
    with pytest.raises(ds_dragonn.DragonnUnsupportedError, match=f"ZeRO stage 3 does not support {key}"):
        ds_dragonn.initialize(model=None, config=cfg)


def test_the_installed_deepspeed_has_the_hook_point():
    check_zero3_hook_point()


class _Changed:
    """A stand-in for a DeepSpeed whose hooked methods take other parameters."""
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
    assert chunk_lengths(numels, world) == chunks
    assert torch.equal(rank_major(grads, world, torch.float64, chunks).flat, flat)  # the hook passes its chunks


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


resumed = ranks_fixture("tests.zero3_cases:resume_runs", "z3resume", timeout=600, pool=POOL)


def test_resume_is_exact_zero_to_fp32_consolidates_and_bytes_are_a_few_percent_of_dense(resumed):
    for r in resumed:
        assert r["notes"] == [], r["notes"]
        assert r["mass"] > 0 and r["loaded_mass"] == pytest.approx(r["mass"], rel=1e-12)
        assert all(torch.equal(a, b) for a, b in zip(r["params"], r["resumed"]))
        assert len(r["consolidated"]) == len(r["at_k"])  # zero_to_fp32 consolidates the weights saved at K
        assert all(torch.equal(a, b.reshape(a.shape)) for a, b in zip(r["at_k"], r["consolidated"]))
        sent, dense = r["bytes"]
        # density 0.01, fp32: 8-byte pairs (index, value) against DeepSpeed's (P-1)/P x 4 bytes per element
        assert 0 < sent <= 0.05 * dense, (sent, dense)


hpz = ranks_fixture("tests.zero3_cases:hpz_runs", "z3hpz", 4, timeout=600, pool="gloo")


def test_hpz_runs_with_the_hook_flat_and_node_aware(hpz):
    """ZeRO-3 with hpZ (``zero_hpz_partition_size`` 2: a second parameter partition per node of 2 ranks), 4 ranks
    as 2 nodes of 2: the gradient reduce-scatter goes through the hook, flat and node-aware; density 1.0 equals
    the dense run within float rounding (the ranks' sums in another order), ranks in sync."""
    runs = hpz
    for name in ("d1", "sparse", "node", "node_d1"):
        assert runs[0][name]["telemetry"]["compressed_reductions"] > 0
        assert runs[0][name]["layout"] == ("2 nodes x 2 ranks" if name.startswith("node") else "flat")
        for r in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r[name]["params"], runs[0][name]["params"]))
    for r in runs:
        for d1 in ("d1", "node_d1"):
            for a, b in zip(r[d1]["params"], r["dense"]["params"]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


more = ranks_fixture("tests.zero3_cases:more_runs", "z3more", timeout=600, pool=POOL)


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("run", ["clip", "bf16_gas2"])
def test_density_one_is_dense_zero3_with_clipping_and_with_bf16_accumulation(more, run):
    """Gradient clipping (every step clips) in fp32; bf16 with gradient accumulation 2: bit for bit at 2 ranks."""
    for r in more:
        assert _equal(r[f"d1_{run}"], r[f"dense_{run}"])
        assert r[f"d1_{run}_norm"] == r[f"dense_{run}_norm"]
    assert more[0]["dense_clip_norm"] > 2 * CLIP  # the last step clipped


def test_gradient_bytes_are_under_3_percent_of_dense_at_density_001(more):
    sent, dense, dense_reductions = more[0]["bytes"]
    assert dense_reductions == 0 and 0 < sent <= 0.03 * dense, (sent, dense)


def test_deepspeeds_zero3_checkpoints_load_both_ways(more):
    """A dense ZeRO-3 checkpoint resumed with DRAGONN at density 1.0 trains as the dense run does; DRAGONN's
    checkpoint is read by zero_to_fp32 and by a plain DeepSpeed engine, giving the same weights."""
    for r in more:
        assert _equal(r["d1_from_dense_k2"], r["dense_k2"])
        assert len(r["notes"]) == 1 and "start empty" in r["notes"][0], r["notes"]
        assert _equal(r["plain_from_d1"], r["d1_from_dense_k2"])
    assert _equal(more[0]["fp32"], more[0]["d1_from_dense_k2"])


def test_nothing_is_lost_with_awkward_sizes(more):
    """float64, parameters of 7, 1 (under the world size), 15 and 1001 elements at 2 ranks, 4 compressed steps of
    the hook: (what every rank received + every rank's residual) x world == the sum of every rank's gradients,
    in ``reduce_scatter_coalesced``'s rank-major layout; and each rank's share has DeepSpeed's chunk lengths."""
    world = len(more)
    lost = [r["lost"] for r in more]
    assert lost[0]["telemetry"]["compressed_reductions"] == 4
    total = sum(rank_major(g, world, torch.float64).flat for r in lost for g in r["grads"])
    chunks = rank_major(lost[0]["grads"][0], world, torch.float64).chunks
    applied = torch.zeros_like(total)
    for step in range(4):
        blocks = []
        for rank, r in enumerate(lost):
            got = r["received"][step]
            assert [t.numel() for t in got] == [max(0, min(c, g.numel() - rank * c))
                                                for c, g in zip(chunks, r["grads"][step])]
            assert all(t.dtype == torch.float64 for t in got)
            blocks += [torch.cat([t, t.new_zeros(c - t.numel())]) for t, c in zip(got, chunks)]
        applied += torch.cat(blocks)
    residual = sum(v for r in lost for v in r["residuals"].values())
    assert all(len(r["residuals"]) == 1 for r in lost) and residual.abs().sum() > 0
    torch.testing.assert_close((applied + residual) * world, total, rtol=0, atol=1e-12)


refused = ranks_fixture("tests.zero3_cases:refused_runs", "z3refused", timeout=300, pool=POOL)


def test_reduce_scatter_false_as_a_string_is_refused_after_initialize(refused):
    for msg in refused:
        assert msg is not None and "'zero_optimization.reduce_scatter' is false" in msg, msg


# -- the momentum mode at ZeRO-3 ---------------------------------------------------------------------------------
mom = ranks_fixture("tests.zero3_cases:momentum_runs", "z3mom", timeout=600, pool=POOL)


def test_momentum_mode_at_density_one_is_the_zero2_momentum_mode(mom):
    """The same model, data and steps: ZeRO-3's momentum mode (local momentum over the rank-major bucket, Adam's
    variance frozen on the fp32 sub-group flats, two refreshes; one sub-group or two) equals ZeRO-2's within float
    rounding; and it is the momentum mode, not dense Adam (the variance was frozen and refreshed, the weights
    differ from dense)."""
    for r in mom:
        assert r["z3_d1"]["compress"] == "momentum" and r["z3_d1"]["frozen"] and r["z3_d1"]["refreshed"] == 2
        for name in ("z3_d1", "z3_d1_subgroups"):
            for a, b in zip(r[name]["params"], r["z2_d1"]["params"]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        # every sub-group's variance frozen at once, though Adam sees one sub-group per step()
        assert r["z3_d1"]["sub_groups"] == r["z3_d1"]["frozen"] == 1
        assert r["z3_d1_subgroups"]["sub_groups"] == r["z3_d1_subgroups"]["frozen"] == 2
        assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(r["z3_d1"]["params"], r["z3_dense"]["params"]))


@pytest.mark.parametrize("name", ["z3_sparse", "z3_sparse_bf16_gas2", "z3_auto"])
def test_momentum_mode_ranks_stay_in_sync_and_compress(mom, name):
    """Density 0.05 in fp32, in bf16 with accumulation 2 (transactional residuals and momenta, two reductions per
    step), and ``compress: auto``, which picks the momentum mode at ZeRO-3 for Adam."""
    run = mom[0][name]
    assert run["compress"] == "momentum" and run["frozen"] and run["refreshed"] == 2
    assert run["telemetry"]["compressed_reductions"] > 0 and run["residual_mass"] > 0
    for r in mom[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r[name]["params"], run["params"]))


def test_momentum_mode_loses_nothing_with_awkward_sizes(mom):
    """float64, 4 compressed steps of the hook: what every rank received + every rank's residual == the sum over
    steps and ranks of the local momenta ``M <- b1 M + (1 - b1) g / P``, in the rank-major layout; the kept
    momenta are each rank's ``M``."""
    world, lost = len(mom), [r["lost"] for r in mom]
    beta = lost[0]["beta"]
    assert lost[0]["telemetry"]["compressed_reductions"] == 4 and beta == 0.9
    chunks = rank_major(lost[0]["grads"][0], world, torch.float64).chunks
    total, applied = 0.0, 0.0
    for r in lost:
        m = 0.0
        for g in r["grads"]:
            m = beta * m + (1.0 - beta) / world * rank_major(g, world, torch.float64).flat
            total = total + m
        (kept,) = r["momenta"].values()
        torch.testing.assert_close(kept, m, rtol=0, atol=1e-12)
    for step in range(4):
        blocks = []
        for r in lost:
            blocks += [torch.cat([t, t.new_zeros(c - t.numel())]) for t, c in zip(r["received"][step], chunks)]
        applied = applied + torch.cat(blocks)
    residual = sum(v for r in lost for v in r["residuals"].values())
    assert residual.abs().sum() > 0
    torch.testing.assert_close(applied + residual, total, rtol=0, atol=1e-12)


mom_resumed = ranks_fixture("tests.zero3_cases:momentum_resume_runs", "z3mresume", timeout=600, pool=POOL)


def test_momentum_mode_resume_is_exact(mom_resumed):
    """Saved after the freeze, resumed by a fresh engine: the residuals, the local momenta and the frozen variance
    (on several fp32 sub-group flats, by position) are restored, and the next steps (a refresh among them) are
    bit-identical."""
    for r in mom_resumed:
        assert r["notes"] == [], r["notes"]
        assert r["mass"] > 0 and r["loaded_mass"] == pytest.approx(r["mass"], rel=1e-12)
        assert r["frozen_loaded"] is not None and all(torch.equal(a, b) for a, b in zip(r["frozen_saved"],
                                                                                          r["frozen_loaded"]))
        assert r["refreshed"][1] >= 1 and r["sub_groups"] == 2 and len(r["frozen_loaded"]) == r["sub_groups"]
        assert all(torch.equal(a, b) for a, b in zip(r["params"], r["resumed"]))
