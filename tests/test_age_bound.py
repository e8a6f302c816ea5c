"""The age bound (``advanced.max_age``, compress/age_bound.py): the blocks tile the bucket once per cycle, the
selection gains the block as a whole tail without duplicates, every entry leaves the residual within the bound
and nothing is lost (float64), the allgather sends the block without positions, and real engines keep ranks
bit-identical and resume exactly (tests/age_bound_cases.py)."""
from __future__ import annotations

import pytest
import torch

from launch.bench.baselines import TopKCompressor
from ds_dragonn.compress.age_bound import age_block, block_capacity, with_age_block
from ds_dragonn.compress.base import Selection
from ds_dragonn.config import DragonnConfig, DragonnConfigError
from ds_dragonn.schedule import DensitySchedule
from tests.multiproc import ranks_fixture


@pytest.mark.parametrize("n", [0, 1, 2, 7, 100, 1001])
@pytest.mark.parametrize("max_age", [2, 3, 7, 100, 1500])
def test_blocks_tile_the_bucket_once_per_cycle(n, max_age):
    last = torch.full((n,), -1, dtype=torch.int64)
    for cycle in range(4):
        seen = torch.zeros(n, dtype=torch.int64)
        for step in range(cycle * max_age, (cycle + 1) * max_age):
            lo, hi = age_block(n, max_age, step)
            assert 0 <= lo <= hi <= n and hi - lo <= block_capacity(n, max_age)
            seen[lo:hi] += 1
            if cycle:  # no entry waits longer than max_age compressed steps for its block
                assert bool((step - last[lo:hi] <= max_age).all())
            last[lo:hi] = step
        assert bool((seen == 1).all())  # every entry exactly once per cycle


@pytest.mark.parametrize("max_age,period", [(100, 100), (100, 101), (100, 51), (50, 100), (300, 100), (7, 2),
                                            (2, 3), (100, 0)])
def test_variance_refreshes_never_starve_a_block(max_age, period):
    """The clock is the schedule's compressed-step index, so a variance refresh (dense, the residual unsent) uses up
    no block whatever its period: every block is sent at least once every ``max_age`` compressed steps, i.e. within
    ``max_age`` plus the refreshes in between. (With the optimizer step as the clock and ``(s − ⌊s/N⌋) mod N``, a
    refresh every 101 steps left one block of ``max_age`` 100 unsent for ~10,000 steps.)"""
    schedule = DensitySchedule(0.001, warmup_steps=13, refresh_steps=period)
    n, last, worst = 60_000, {}, 0  # 60000: no empty blocks at these max_age
    refreshes_per_window = -(-max_age // (period - 1)) if period else 0
    for step in range(schedule.warmup_steps, schedule.warmup_steps + 30 * max_age + 500):
        if schedule.refresh(step):
            continue
        block = age_block(n, max_age, schedule.compressed_index(step))
        if block in last:
            worst = max(worst, step - last[block])
        last[block] = step
    assert len(last) == max_age
    assert max_age <= worst <= max_age + refreshes_per_window


def test_the_compressed_index_skips_the_warm_up_and_the_refreshes():
    schedule = DensitySchedule(0.01, warmup_steps=5, refresh_steps=4)  # refreshes at steps 8, 12, 16, ...
    assert [schedule.compressed_index(s) for s in range(0, 14)] == [0, 0, 0, 0, 0, 0, 1, 2, 3, 3, 4, 5, 6, 6]
    assert [s for s in range(14) if schedule.refresh(s)] == [8, 12]
    assert DensitySchedule(0.01, warmup_steps=2).compressed_index(10) == 8  # no refreshes: steps since the warm-up


def test_no_bound_and_bad_arguments():
    assert age_block(100, 0, 5) == (0, 0) and block_capacity(100, 0) == 0
    with pytest.raises(ValueError, match="max_age"):
        age_block(100, -1, 0)
    with pytest.raises(ValueError, match="index=-1"):
        age_block(100, 3, -1)
    with pytest.raises(ValueError, match="numel=-5"):
        age_block(-5, 3, 1)


@pytest.mark.parametrize("n, max_age, step", [(1, 2, 0), (1, 2, 1), (10, 3, 2), (1001, 7, 0), (1001, 7, 6),
                                              (5000, 100, 37)])
def test_selection_gains_the_block_as_its_whole_tail(n, max_age, step):
    g = torch.Generator().manual_seed(n + step)
    flat = torch.randn(n, generator=g)
    sel = TopKCompressor(0.05).compress(flat, seed=1)
    lo, hi = age_block(n, max_age, step)
    out = with_age_block(sel, flat, max_age, step)
    idx = out.indices.long()
    assert out.whole == hi - lo and out.capacity == sel.capacity + (block_capacity(n, max_age) if hi > lo else 0)
    assert idx.unique().numel() == idx.numel()  # a selected entry inside the block is not sent twice
    assert torch.equal(idx[out.count - out.whole:], torch.arange(lo, hi))
    assert torch.equal(out.values, flat[idx])
    old = sel.indices.long()
    assert torch.equal(idx[:out.count - out.whole], old[(old < lo) | (old >= hi)])  # the head keeps its order
    assert set(idx.tolist()) == set(old.tolist()) | set(range(lo, hi))


def test_an_empty_block_returns_the_selection_and_a_whole_tail_is_refused():
    flat = torch.randn(10)
    sel = TopKCompressor(0.2).compress(flat, seed=1)
    assert with_age_block(sel, flat, 0, 3) is sel
    assert with_age_block(sel, flat, 20, 15) is sel  # past the last block of a short bucket
    with pytest.raises(ValueError, match="whole"):
        with_age_block(Selection(sel.indices, sel.values, sel.threshold, sel.k, sel.capacity, 1), flat, 3, 0)


def test_config_key():
    assert DragonnConfig(enabled=True).max_age == "auto"  # plan.resolve_defaults: tests/test_defaults.py
    assert DragonnConfig(enabled=True, advanced={"max_age": 0}).max_age == 0
    assert DragonnConfig(enabled=True, advanced={"max_age": 100}).max_age == 100
    for bad in (1, -1, 2.5, "100", True):
        with pytest.raises(DragonnConfigError, match="max_age"):
            DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "advanced": {"max_age": bad}}})
    with pytest.raises(DragonnConfigError, match="advanced"):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "max_age": 100}})


exchanged = ranks_fixture("tests.age_bound_cases:exchange_runs", "age_exchange", world=3, timeout=300, pool="gloo")


@pytest.mark.parametrize("values", ["auto", "int4"])
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_every_entry_leaves_the_residual_within_the_bound(exchanged, dtype, values):
    """allgather, 3 ranks, density 0.001 (k = 1 of 1001), one gradient then zeros: with max_age 7 the sum of the
    decoded outputs is Σ_ranks x (float64 reference) and the residual holds only the rounding; without the bound
    most of it still waits. Ranks bit-identical."""
    from tests.age_bound_cases import MAX_AGE
    runs = [e[("allgather", dtype, values, MAX_AGE)] for e in exchanged]
    truth = sum(r["x"].double() for r in runs)
    # a bf16 wire sums the ranks' values in bf16: two roundings of partial sums, each ≤ 2^-8 of Σ |x|
    bound = 1e-5 if dtype == "torch.float32" else 2 ** -7 * sum(r["x"].double().abs() for r in runs)
    for r in runs:
        assert torch.equal(r["total"], runs[0]["total"])
        left = sum(q["residual"].double() for q in runs)  # nothing lost: applied + what waits = Σ x
        assert bool(((r["total"] + left - truth).abs() <= bound).all())
    scale = float(truth.abs().max())
    if dtype == "torch.float32" and values == "auto":
        assert all(float(r["residual"].abs().max()) == 0.0 for r in runs)
    else:  # only the rounding of the last send of each entry waits
        assert all(float(r["residual"].abs().max()) < 0.2 * scale for r in runs)
    unbounded = [e[("allgather", dtype, values, 0)] for e in exchanged]
    assert sum(int((r["residual"] != 0).sum()) for r in unbounded) > 900


@pytest.mark.parametrize("dtype, itemsize", [("torch.float32", 4), ("torch.bfloat16", 2)])
def test_allgather_sends_the_block_without_positions(exchanged, dtype, itemsize):
    """A zero step of k = 1 pair plus a block of ceil(1001 / 7) = 143 entries: the bytes grow by about the block's
    values, not by its positions (3 ranks: each row goes to 2 others)."""
    from tests.age_bound_cases import MAX_AGE
    with_block = exchanged[0][("allgather", dtype, "auto", MAX_AGE)]["sent"][1]
    without = exchanged[0][("allgather", dtype, "auto", 0)]["sent"][1]
    m = block_capacity(1001, MAX_AGE)
    assert 2 * m * itemsize <= with_block - without < 2 * (m * itemsize + 64)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_partitioned_exchange_takes_the_block_as_pairs(exchanged, dtype):
    """The partitioned exchange sends the block as ordinary pairs to its owners: the workers' residuals empty within
    the bound (the owners' re-selection keeps its own residual, which the bound does not cover); ranks identical."""
    from tests.age_bound_cases import MAX_AGE
    runs = [e[("partitioned", dtype, "auto", MAX_AGE)] for e in exchanged]
    for r in runs:
        assert torch.equal(r["total"], runs[0]["total"]) and bool(torch.isfinite(r["total"]).all())
    if dtype == "torch.float32":
        assert all(float(r["residual"].abs().max()) == 0.0 for r in runs)


engines = ranks_fixture("tests.age_bound_cases:engine_runs", "age", timeout=600, pool="gloo")


def test_engines_keep_ranks_bit_identical_with_the_bound(engines):
    from tests.age_bound_cases import RUNS
    for name in RUNS:
        a, b = engines[0][name], engines[1][name]
        assert a["max_age"] == 3, name
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), name
        assert a["telemetry"]["compressed_reductions"] > 0, (name, a["telemetry"])


def test_resume_is_exact_with_the_bound(engines):
    for rank in engines:
        assert all(torch.equal(p, q) for p, q in zip(rank["straight"], rank["resumed"]))


@pytest.mark.parametrize("max_age, costly", [(0, False), (1000, False), (2, True)])
def test_the_byte_check_counts_the_block(max_age, costly):
    """The dense-or-compressed byte check adds the block as pairs: at max_age 2 (half the bucket each step) the
    pairs cost more than the dense allreduce, so policy auto keeps the bucket dense."""
    from types import SimpleNamespace
    from ds_dragonn.engine.decision import BucketDecision
    from ds_dragonn.exchange import AllgatherExchange
    cfg = DragonnConfig(enabled=True, density=0.001, warmup_steps=0, density_warmup_steps=0,
                        advanced={"max_age": max_age})
    backend = SimpleNamespace(world_size=2)
    pipeline = SimpleNamespace(backend=backend, exchange=AllgatherExchange(backend))
    choice = BucketDecision(cfg).choose("b", 100_000, 5, pipeline, torch.bfloat16)
    assert choice.fixed is costly  # fixed: dense for the bytes, whatever the timings (else the policy probes)
    assert not costly or choice.dense
