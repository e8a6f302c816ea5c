"""The compressor's per-tensor variant (compress/segments.py, the kernels' segmented path: the DRAGONN paper's,
kept for benchmarks; the engine selects globally), global selection in engines, and the density schedule."""
from __future__ import annotations

import math

import pytest
import torch

from ds_dragonn.compress import DragonnCompressor, RandomKCompressor, TopKCompressor, max_pairs, target_k
from ds_dragonn.compress.base import segment_seed
from ds_dragonn.compress.kernels import cpu_table
from ds_dragonn.compress.segments import Segments, plan_segments
from ds_dragonn.config import DragonnConfig, DragonnConfigError
from ds_dragonn.schedule import UNDECIDED, DensitySchedule
from tests.multiproc import ranks_fixture

needs_cpu_kernel = pytest.mark.skipif(not cpu_table.available(), reason="no C++ compiler")

#: awkward layouts: empty tensors, a 1-element tensor, tensors smaller than k, sizes not divisible by anything
SHAPES = [
    [(192,), (576, 192), (7,), (0,), (192, 768), (1,), (3000,)],
    [(1,)],
    [(0,), (5, 0), (3, 3)],
    [(37, 41), (37,), (1, 1), (4099,), (2, 2049)],
]


def _random(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3  # heavy-tailed, some near zero
    if n > 10:
        x[torch.randint(0, n, (n // 10,), generator=g)] = 0.0
    return x.to(dtype)


def test_plan_marks_small_and_1d_tensors_whole():
    seg = plan_segments([(10, 10), (100,), (3, 4), (0,), (50, 50)], min_numel=13, compress_1d=False)
    assert seg.offsets == (0, 100, 200, 212, 212, 2712)
    assert seg.whole == (False, True, True, True, False)
    assert plan_segments([(100,)], 0, compress_1d=True).whole == (False,)
    assert seg.ks(0.01) == (1, 100, 12, 0, 25)
    assert "5 tensors, 3 sent whole" in seg.describe()


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("layout", range(len(SHAPES)))
def test_cpu_kernel_equals_the_reference_per_tensor(dtype, density, layout):
    seg = plan_segments(SHAPES[layout], min_numel=100, compress_1d=False)
    x = _random(seg.numel, dtype, seed=layout * 7 + int(density * 1000))
    for seed in (0, 12345):
        a = DragonnCompressor(density, kernel="cpu").compress(x, seed, seg)
        b = DragonnCompressor(density, kernel="reference").compress(x, seed, seg)
        assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
        assert a.k == b.k == sum(seg.ks(density)) and a.capacity == b.capacity
        assert float(a.threshold) == float(b.threshold)


@pytest.mark.parametrize("kernel", ["reference", pytest.param("cpu", marks=needs_cpu_kernel)])
def test_each_segment_is_the_selection_of_its_slice(kernel):
    """Per tensor = the global selection applied to each slice alone, with the segment's seed."""
    seg = plan_segments(SHAPES[0], min_numel=100, compress_1d=False)
    x = _random(seg.numel, torch.float32, 3)
    comp = DragonnCompressor(0.01, kernel=kernel)
    sel = comp.compress(x, 99, seg)
    idx = sel.indices.long()
    for s, (lo, hi) in enumerate(zip(seg.offsets[:-1], seg.offsets[1:])):
        mine = idx[(idx >= lo) & (idx < hi)]
        if seg.whole[s]:  # every element (zeros included: their positions are implicit on the wire), in order
            assert torch.equal(mine, torch.arange(lo, hi))
            continue
        if hi == lo:
            assert mine.numel() == 0
            continue
        alone = DragonnCompressor(0.01, kernel="reference").compress(x[lo:hi], segment_seed(99, s))
        assert torch.equal(mine.sort().values, alone.indices.long().sort().values + lo)
    assert torch.equal(sel.values, x[idx])
    assert sel.whole == sum(b - a for a, b, w in zip(seg.offsets[:-1], seg.offsets[1:], seg.whole) if w)
    assert torch.equal(idx[sel.count - sel.whole:], torch.cat([torch.arange(a, b) for a, b, w in
                                                               zip(seg.offsets[:-1], seg.offsets[1:], seg.whole) if w]))


@pytest.mark.parametrize("compressor", [TopKCompressor, RandomKCompressor])
def test_baselines_select_exactly_k_per_segment(compressor):
    seg = plan_segments(SHAPES[3], min_numel=0, compress_1d=True)
    x = _random(seg.numel, torch.float64, 5) + 1e-3  # no zeros: top-k keeps exactly k
    sel = compressor(0.05).compress(x, 7, seg)
    idx = sel.indices.long()
    for lo, hi, k in zip(seg.offsets[:-1], seg.offsets[1:], seg.ks(0.05)):
        mine = idx[(idx >= lo) & (idx < hi)]
        assert mine.numel() == k
        if compressor is TopKCompressor:  # the exact top-k of the slice (float64 reference)
            ref = torch.topk(x[lo:hi].abs(), k).indices + lo
            assert set(mine.tolist()) == set(ref.tolist())


@pytest.mark.parametrize("kernel", ["reference", pytest.param("cpu", marks=needs_cpu_kernel)])
def test_a_quiet_tensor_gets_its_share_only_per_tensor(kernel):
    """A tensor 1000x quieter than its neighbour gets ~k_s pairs per tensor and none under one global threshold."""
    g = torch.Generator().manual_seed(11)
    loud, quiet = torch.randn(50_000, generator=g), torch.randn(20_000, generator=g) * 1e-3
    x = torch.cat([loud, quiet])
    seg = Segments((0, 50_000, 70_000), (False, False))
    comp = DragonnCompressor(0.01, kernel=kernel)
    per = comp.compress(x, 1, seg).indices.long()
    glob = comp.compress(x, 1).indices.long()
    assert int((glob >= 50_000).sum()) == 0
    k_quiet = target_k(20_000, 0.01)
    assert 0.7 * k_quiet <= int((per >= 50_000).sum()) <= max_pairs(k_quiet)


@pytest.mark.parametrize("kernel", ["reference", pytest.param("cpu", marks=needs_cpu_kernel)])
def test_ties_stay_within_the_byte_bound(kernel):
    seg = plan_segments([(300, 300), (90_000,)], 0, compress_1d=True)
    x = torch.ones(seg.numel)  # every element ties at the threshold: the tables fill up
    sel = DragonnCompressor(0.01, kernel=kernel).compress(x, 0, seg)
    assert sel.count <= max_pairs(sum(seg.ks(0.01)))


@pytest.mark.parametrize("kernel", ["reference", pytest.param("cpu", marks=needs_cpu_kernel)])
def test_whole_tensors_do_not_lend_their_bound_to_the_selected_ones(kernel):
    """Ties fill the matrix's table; the whole 1-D tensor beside it must not raise the matrix's own bound."""
    seg = Segments((0, 90_000, 140_000), (False, True))
    x = torch.cat([torch.ones(90_000), torch.randn(50_000)])
    sel = DragonnCompressor(0.01, kernel=kernel).compress(x, 0, seg)
    head = sel.indices.long()[:sel.count - sel.whole]
    assert sel.whole == 50_000 and head.numel() <= max_pairs(900) and bool((head < 90_000).all())
    assert sel.count <= sel.capacity


def test_segments_must_tile_the_buffer():
    comp = DragonnCompressor(0.01, kernel="reference")
    with pytest.raises(ValueError, match="segments cover 10 elements but the buffer holds 11"):
        comp.compress(torch.randn(11), 0, Segments((0, 10), (False,)))
    with pytest.raises(ValueError, match="ascend"):
        comp.compress(torch.randn(10), 0, Segments((0, 8, 5, 10), (False, False, False)))
    with pytest.raises(TypeError, match="Segments.of"):
        comp.compress(torch.randn(10), 0, Segments([0, 10], [False]))
    assert comp.compress(torch.randn(10), 0, Segments.of([0, 10], [False])).count >= 1
    with pytest.raises(ValueError, match="negative dimension"):
        plan_segments([(-3, 4)])


def test_empty_and_all_zero_buckets():
    comp = DragonnCompressor(0.01, kernel="reference")
    assert comp.compress(torch.empty(0), 0, Segments((0,), ())).count == 0
    assert comp.compress(torch.empty(0), 0, Segments((0, 0), (True,))).count == 0
    seg = plan_segments([(100,), (100, 100)], 0, compress_1d=False)
    sel = comp.compress(torch.zeros(seg.numel), 0, seg)
    assert sel.count == sel.whole == 100  # the whole 1-D tensor, zeros included; nothing of the matrix


# -- the density schedule ---------------------------------------------------------------------------------
def test_density_schedule_is_dgc_exponential():
    s = DensitySchedule(0.001, warmup_steps=10, density_warmup_steps=40, density_warmup_start=0.25)
    assert all(s.at(t) is None and s.dense(t) for t in range(10))
    assert s.at(10) == 0.25 and s.at(50) == s.at(1000) == 0.001
    ds = [s.at(t) for t in range(10, 51)]
    assert all(a > b for a, b in zip(ds, ds[1:]))  # strictly falling
    for j in (0, 13, 39):  # float64 reference: log-linear in the step
        ref = math.exp(math.log(0.25) + (math.log(0.001) - math.log(0.25)) * j / 40)
        assert s.at(10 + j) == pytest.approx(ref, rel=1e-12)
    assert s.warming(10) and s.warming(49) and not s.warming(50) and not s.warming(9)
    assert s.describe().startswith("10 dense warm-up steps") and "0.25 -> 0.001 over 40 steps" in s.describe()


def test_no_density_warmup_when_the_start_is_not_above_the_density():
    s = DensitySchedule(0.5, 0, 100, 0.25)
    assert s.at(0) == 0.5 and not s.warming(0)
    assert DensitySchedule(0.01, 0, 0, 0.25).at(0) == 0.01


@pytest.mark.parametrize("warm, ramp", [(0, 100), (1, 100), (30, 100), (33, 100), (34, 102), (100, 300),
                                        (517, 1551)])
def test_auto_density_warmup_is_three_times_the_dense_warmup_at_least_100(warm, ramp):
    s = DensitySchedule(0.01, warm, "auto", 0.25)
    assert s.steps == ramp and s.auto_steps
    assert s.at(warm) == 0.25 and s.at(warm + ramp) == 0.01 and s.warming(warm + ramp - 1)
    assert not s.warming(warm + ramp)
    j = ramp // 3  # float64 reference
    assert s.at(warm + j) == pytest.approx(0.25 * (0.01 / 0.25) ** (j / ramp), rel=1e-12)
    assert f"over {ramp} steps" in s.describe()


def test_auto_density_warmup_follows_a_dense_warmup_decided_later():
    s = DensitySchedule(0.001, UNDECIDED, "auto", 0.25)
    assert s.at(10_000) is None and "3 times the dense warm-up (at least 100 steps" in s.describe()
    s.warmup_steps = 80  # what the hook's online tracker does (engine/base.py _end_warmup)
    assert s.steps == 240 and s.at(80) == 0.25 and s.at(320) == 0.001 and s.at(319) > 0.001
    assert DensitySchedule(0.5, 80, "auto", 0.25).steps == 0  # a start not above the density: none
    assert DensitySchedule(0.01, 80, 7, 0.25).steps == 7      # a number stays that number


def test_default_config_schedule_resolves_auto_density_warmup():
    cfg = DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "warmup_steps": 50}})
    assert DensitySchedule.from_config(cfg).steps == 150
    cfg = DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "warmup_steps": 50, "density_warmup_steps": 0}})
    assert DensitySchedule.from_config(cfg).steps == 0
    # local steps send every outer step at the density: no density warm-up, "auto" or a number
    for ramp in ("auto", 200):
        cfg = DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "sync": "local_steps", "local_steps": 3,
                                                        "warmup_steps": 50, "density_warmup_steps": ramp}})
        schedule = DensitySchedule.from_config(cfg)
        assert schedule.steps == 0 and schedule.at(50) == schedule.at(51) == 0.01 and not schedule.warming(51)


def test_config_validates_the_warmup_keys():
    d = DragonnConfig()
    assert d.density_warmup_steps == "auto" and d.warmup_steps == "auto" and d.density_warmup_start == 0.25
    for key, bad in [("density_warmup_steps", -1), ("density_warmup_steps", "Auto"), ("density_warmup_steps", 2.5),
                     ("density_warmup_steps", True)]:
        with pytest.raises(DragonnConfigError, match=f"dragonn.{key}"):
            DragonnConfig.from_ds_config({"dragonn": {"enabled": True, key: bad}})
    for bad in (0.0, 1.5):
        with pytest.raises(DragonnConfigError, match="dragonn.advanced.density_warmup_start"):
            DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "advanced": {"density_warmup_start": bad}}})


# -- in real engines ----------------------------------------------------------------------------------------
engines = ranks_fixture("tests.selection_cases:selection_runs", "selection", pool="gloo")


def test_global_selection_starves_the_quiet_tensors(engines):
    for name in ("global", "zero2_global"):
        moved = engines[0][name]["moved"]
        assert moved["quiet"] == 0 and moved["bias"] == 0, (name, moved)
        assert moved["loud.weight"] > 0


def test_ranks_stay_bit_identical(engines):
    for name in RUNS_NAMES:
        assert all(torch.equal(a, b) for a, b in zip(engines[0][name]["params"], engines[1][name]["params"]))


def test_defaults_warm_up_dense_then_the_density(engines):
    d = engines[0]["defaults"]["telemetry"]
    assert d["dense_reductions"] == 6 and d["compressed_reductions"] == 0  # 30 dense warm-up steps
    w = engines[0]["density_warmup"]
    assert w["telemetry"]["dense_reductions"] == 2 and w["telemetry"]["compressed_reductions"] == 4
    # the last step (global step 5) is compressed step 3 of the 100-step warm-up from 0.25 to 0.01
    assert w["density"] == pytest.approx(0.25 * (0.01 / 0.25) ** (3 / 100))


RUNS_NAMES = ("defaults", "density_warmup", "global", "zero2_global")


exchanged = ranks_fixture("tests.selection_cases:exchange_runs", "exchange", 3, timeout=300, pool="gloo")


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_whole_tensors_travel_as_values_and_nothing_is_lost(exchanged, dtype):
    """allgather, 3 ranks: decoded sum == Σ_ranks (raw − residual) (float64 reference), whole tensors exact,
    and the whole tensors' indices are not on the wire."""
    runs = [e["out"][("allgather", dtype)] for e in exchanged]
    seg = exchanged[0]["segments"]
    sent = sum(r["x"].double() - r["residual"].double() for r in runs)
    for r in runs:
        assert torch.equal(r["out"], runs[0]["out"])  # every rank decodes the same
        tol = 1e-6 if dtype == "torch.float32" else 2e-2
        assert torch.allclose(r["out"].double(), sent, rtol=tol, atol=tol)
    raw = sum(r["x"].double() for r in runs)
    for lo, hi, w in zip(seg.offsets[:-1], seg.offsets[1:], seg.whole):
        if w:  # sent whole: nothing stays behind
            assert all(not bool(r["residual"][lo:hi].any()) for r in runs)
            assert torch.allclose(runs[0]["out"][lo:hi].double(), raw[lo:hi], rtol=tol, atol=tol)
    whole = sum(b - a for a, b, w in zip(seg.offsets[:-1], seg.offsets[1:], seg.whole) if w)
    vb = 4 if dtype == "torch.float32" else 2
    c = max(r["kept"] for r in runs)
    align8 = lambda v: -(-v // 8) * 8  # noqa: E731
    from ds_dragonn.exchange.wire import index_block_bytes
    positions = index_block_bytes(align8(c - whole), runs[0]["x"].numel(), torch.int32)  # packed (exchange/wire.py)
    assert positions < align8(c - whole) * 4
    assert runs[0]["bytes_sent"] == 2 * (4 * 8 + positions + align8(c) * vb)
    assert runs[0]["bytes_sent"] < 2 * (4 * 8 + align8(c) * (4 + vb))  # what pairs would cost


def test_whole_tensors_through_the_partitioned_exchange(exchanged):
    for dtype in ("torch.float32", "torch.bfloat16"):
        runs = [e["out"][("partitioned", dtype)] for e in exchanged]
        assert all(torch.equal(r["out"], runs[0]["out"]) for r in runs)
        assert bool(torch.isfinite(runs[0]["out"]).all()) and float(runs[0]["out"].abs().sum()) > 0
