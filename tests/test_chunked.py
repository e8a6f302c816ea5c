"""Chunk-wise selection (``advanced.selection: chunked``, compress/chunks.py): against an exact per-chunk top-k in
float64, awkward sizes, every chunk's turn, identical kernels, the config key, and real engines (tests/chunked_cases.py)."""
from __future__ import annotations

import statistics

import pytest
import torch

from ds_dragonn import constants
from ds_dragonn.compress import DragonnCompressor, build_compressor, target_k
from launch.bench.baselines import TopKCompressor
from ds_dragonn.compress.chunks import chunk_ks, chunk_layout, chunk_rank
from ds_dragonn.compress.kernels import cpu_table
from ds_dragonn.config import DragonnConfig, DragonnConfigError
from ds_dragonn.engine.state import compare
from tests.multiproc import ranks_fixture

needs_cpu_kernel = pytest.mark.skipif(not cpu_table.available(), reason="no C++ compiler")
KERNELS = ["reference", pytest.param("cpu", marks=needs_cpu_kernel)]
C = 4096


def _random(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3  # heavy-tailed, some near zero
    return x.to(dtype)


def _per_chunk(sel, layout):
    """Per chunk: (lo, hi, local positions kept)."""
    idx = sel.indices.long()
    return [(lo, hi, idx[(idx >= lo) & (idx < hi)] - lo) for lo, hi in zip(layout.offsets[:-1], layout.offsets[1:])]


# -- the layout and the budget ------------------------------------------------------------------------------
@pytest.mark.parametrize("n, offsets", [(1, (0, 1)), (4095, (0, 4095)), (4096, (0, 4096)), (4097, (0, 4097)),
                                        (8192, (0, 4096, 8192)), (10_000, (0, 4096, 10_000))])
def test_layout_joins_a_short_tail_to_the_last_chunk(n, offsets):
    assert chunk_layout(n, C).offsets == offsets
    with pytest.raises(ValueError, match="chunk size"):
        chunk_layout(10, 0)


@pytest.mark.parametrize("n", [1, 7, 4095, 4096, 4097, 3 * 4096 + 5, 100_003])
@pytest.mark.parametrize("density", [1e-5, 1e-4, 0.001, 0.01, 0.3, 1.0])
def test_budget_sums_to_the_global_k_and_each_chunk_gets_its_share(n, density):
    layout = chunk_layout(n, C)
    lens = [b - a for a, b in zip(layout.offsets[:-1], layout.offsets[1:])]
    for seed in (0, 1, 12345):
        ks = chunk_ks(layout, density, seed).tolist()
        assert sum(ks) == target_k(n, density)  # the same bytes as the global selection
        for k, length in zip(ks, lens):
            assert 0 <= k <= length
            if target_k(n, density) > 1:  # ⌊density·length⌋ or ⌈density·length⌉ (float64 reference)
                assert int(density * length) - 1 <= k <= -int(-density * length // 1) + 1


def test_chunks_below_one_element_take_turns():
    """density × chunk < 1: some chunks get k_c = 0 in a step; the rotation gives each its turns."""
    layout = chunk_layout(40 * C, C)
    turns = torch.zeros(40, dtype=torch.int64)
    for seed in range(300):
        ks = chunk_ks(layout, 1e-4, seed)
        assert int(ks.sum()) == target_k(40 * C, 1e-4) and int(ks.max()) <= 1
        turns += ks
    share = 300 * 1e-4 * C  # expected turns per chunk (~123)
    assert int(turns.min()) >= 0.7 * share and int(turns.max()) <= 1.3 * share


def test_sample_rank_misses_the_kth_value_rarely():
    """P(Binomial(s, k/n) ≥ r) ≤ CHUNK_MISS, checked with an exact float64 sum; r = k on a whole-chunk sample."""
    import math
    for s, k, n in [(64, 41, 4096), (64, 5, 4096), (64, 1, 4096), (64, 400, 4096), (64, 2000, 8000)]:
        r = chunk_rank(s, k, n, 0.01)
        p = k / n
        tail = lambda r: sum(math.comb(s, j) * p ** j * (1 - p) ** (s - j) for j in range(r, s + 1))  # noqa: E731
        assert tail(r) <= 0.01 and (r == 1 or tail(r - 1) > 0.01), (s, k, n, r)
    assert chunk_rank(64, 3, 50, 0.01) == 3  # the sample is the chunk: the exact k-th


# -- against an exact per-chunk top-k (float64) ------------------------------------------------------------------
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("density", [0.01, 0.001])
def test_close_to_the_exact_top_k_of_every_chunk(kernel, density):
    """Each chunk keeps at most k_c, ~k_c on average; its kept elements rank near the top (the threshold sits
    between the exact k_c-th and ~2k_c-th magnitudes); most of the exact per-chunk top-k is caught (the misses are
    DRAGONN's collisions, ~12 %, as for the global threshold)."""
    n = 24 * C + 777
    x = _random(n, seed=3)
    comp = DragonnCompressor(density, kernel=kernel, chunk=C)
    layout = chunk_layout(n, C)
    ratios, recalls, deep = [], [], 0
    for seed in range(6 if kernel == "cpu" else 2):
        sel = comp.compress(x, seed)
        ks = chunk_ks(layout, density, seed).tolist()
        assert sel.k == sel.capacity == target_k(n, density) and sel.count <= sel.k
        assert torch.equal(sel.values, x[sel.indices.long()])
        for (lo, hi, mine), kc in zip(_per_chunk(sel, layout), ks):
            mags = x[lo:hi].double().abs()
            order = torch.argsort(mags, descending=True)
            assert mine.numel() <= kc
            ratios.append(mine.numel() / kc)
            recalls.append(len(set(order[:kc].tolist()) & set(mine.tolist())) / kc)
            kth2 = mags[order[min(2 * kc, hi - lo - 1)]]
            deep += int(mine.numel() > 0 and bool(mags[mine].min() < kth2))  # kept below the exact 2k_c-th
    assert statistics.mean(ratios) >= 0.95
    assert sum(r < 0.8 for r in ratios) <= 0.05 * len(ratios)  # CHUNK_MISS: the threshold rarely lands too high
    assert statistics.mean(recalls) >= 0.8
    assert deep <= 0.02 * len(ratios)


def test_topk_chunked_is_the_exact_top_k_of_every_chunk():
    n = 5 * C + 123
    x = _random(n, torch.float64, 5) + 1e-3
    sel = TopKCompressor(0.01, chunk=C).compress(x, 7)
    layout = chunk_layout(n, C)
    for (lo, hi, mine), kc in zip(_per_chunk(sel, layout), chunk_ks(layout, 0.01, 7).tolist()):
        assert set(mine.tolist()) == set(torch.topk(x[lo:hi].abs(), kc).indices.tolist())


# -- awkward sizes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n", [0, 1, 2, 100, C - 1, C + 1, 2 * C + 2047, 3 * C])
@pytest.mark.parametrize("density", [1e-4, 0.01, 0.5, 1.0])
def test_awkward_sizes(kernel, n, density):
    x = _random(n, seed=n) + (0.5 if n else 0)  # no zeros
    sel = DragonnCompressor(density, kernel=kernel, chunk=C).compress(x, 9)
    k = target_k(n, density)
    assert sel.k == k and sel.count <= k
    idx = sel.indices.long()
    assert idx.unique().numel() == idx.numel() and (n == 0 or bool((idx >= 0).all() and (idx < n).all()))
    if n and density >= 0.5:  # a direct table (m ≥ chunk: no collisions) and a threshold below the k_c-th (as
        # in ≥ 99 % of chunks): the cap keeps the exact top k_c (compared as magnitudes: ties may pick either)
        layout = chunk_layout(n, C)
        for (lo, hi, mine), kc in zip(_per_chunk(sel, layout), chunk_ks(layout, density, 9).tolist()):
            mags = x[lo:hi].double().abs()
            assert torch.equal(mags[mine].sort().values, torch.topk(mags, kc).values.sort().values)
    if density == 1.0:
        assert sel.count == n


def test_every_chunk_gets_a_turn_where_global_starves_it():
    """A chunk 1000x quieter than the others: the global threshold sends nothing of it, chunk-wise its k_c."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(8 * C, generator=g)
    x[3 * C:4 * C] *= 1e-3
    glob = DragonnCompressor(0.01).compress(x, 1).indices.long()
    chunked = DragonnCompressor(0.01, chunk=C).compress(x, 1).indices.long()
    quiet = lambda idx: int(((idx >= 3 * C) & (idx < 4 * C)).sum())  # noqa: E731
    assert quiet(glob) == 0
    assert quiet(chunked) >= 0.8 * int(chunk_ks(chunk_layout(8 * C, C), 0.01, 1)[3])


@pytest.mark.parametrize("density, sends", [(0.01, True), (1 / C, True), (1e-4, False)])
def test_non_finite_entries_are_sent_while_every_chunk_sends(density, sends):
    comp = DragonnCompressor(density, chunk=C)
    assert comp.sends_non_finite is sends
    x = _random(6 * C + 100, seed=2)
    x[5 * C + 17] = float("nan")
    if sends:
        for seed in range(5):
            assert not bool(torch.isfinite(comp.compress(x, seed).values).all())


# -- kernels --------------------------------------------------------------------------------------------------
@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("density", [1e-4, 0.001, 0.01, 0.3])
@pytest.mark.parametrize("n", [1, 3000, 5 * C + 17])
def test_cpu_kernel_equals_the_reference(dtype, density, n):
    x = _random(n, dtype, seed=n)
    if n > 100:
        x[::97] = x[5]  # ties
        x[n // 2] = float("inf")
        x[n // 3] = 0.0
    for seed in (0, 4242):
        a = DragonnCompressor(density, kernel="cpu", chunk=C).compress(x, seed)
        b = DragonnCompressor(density, kernel="reference", chunk=C).compress(x, seed)
        assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
        assert a.k == b.k and a.capacity == b.capacity and float(a.threshold) == float(b.threshold)


def test_bad_chunk_sizes_are_refused():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk"):
            DragonnCompressor(0.01, chunk=bad)


# -- the config key ----------------------------------------------------------------------------------------------
def test_config_key_builds_a_chunked_compressor():
    cfg = DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "advanced": {"selection": "chunked"}}})
    assert cfg.selection.value == "chunked" and cfg.model_dump(mode="json")["selection"] == "chunked"
    assert build_compressor(cfg).chunk == constants.CHUNK_SIZE
    assert build_compressor(DragonnConfig(enabled=True)).chunk is None  # the default stays global


@pytest.mark.parametrize("bad", ["per_tensor", "Chunked", 1, None, True])
def test_config_refuses_bad_selection_values(bad):
    with pytest.raises(DragonnConfigError, match="'dragonn.advanced.selection'"):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "advanced": {"selection": bad}}})


def test_config_selection_belongs_under_advanced():
    with pytest.raises(DragonnConfigError, match="'dragonn.selection' belongs under 'advanced'"):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "selection": "chunked"}})


def test_resume_with_another_selection_keeps_the_residuals_and_says_so():
    saved = {"world_size": 2, "rank": 0, "bucketing": {}, "parameters": [], "exchange": "allgather",
             "dragonn": DragonnConfig(enabled=True).model_dump(mode="json")}
    now = {**saved, "dragonn": DragonnConfig(enabled=True, advanced={"selection": "chunked"}).model_dump(mode="json")}
    reset, fold, kept = compare(saved, now)
    assert not reset and not fold and kept == ["dragonn.selection global (now chunked)"]


# -- in real engines and exchanges (2 gloo ranks) ----------------------------------------------------------
engines = ranks_fixture("tests.chunked_cases:engine_runs", "chunked", timeout=600, pool="gloo")


def test_engines_select_chunk_wise_and_ranks_stay_bit_identical(engines):
    from tests.chunked_cases import RUNS
    for name in RUNS:
        a, b = engines[0][name], engines[1][name]
        assert a["chunk"] == constants.CHUNK_SIZE, name
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), name
        t = a["telemetry"]
        assert t["compressed_reductions"] > 0, (name, t)


def test_resume_is_exact_and_another_selection_is_kept(engines):
    for rank in engines:
        assert all(torch.equal(p, q) for p, q in zip(rank["straight"], rank["resumed"]))
        assert rank["residuals_equal"]
        assert any("dragonn.selection chunked (now global)" in n for n in rank["notes"]), rank["notes"]


exchanged = ranks_fixture("tests.chunked_cases:exchange_runs", "chunked_exchange", timeout=300, pool="gloo")


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_nothing_is_lost_through_the_exchanges(exchanged, dtype):
    """allgather: decoded sum == Σ_ranks (raw − residual) (float64 reference); both exchanges bit-identical
    across ranks; the quiet chunk is sent; at most k pairs a rank."""
    runs = [e[("allgather", dtype)] for e in exchanged]
    sent = sum(r["x"].double() - r["residual"].double() for r in runs)
    tol = 1e-6 if dtype == "torch.float32" else 2e-2
    for r in runs:
        assert torch.equal(r["out"], runs[0]["out"]) and r["kept"] <= r["k"]
        assert torch.allclose(r["out"].double(), sent, rtol=tol, atol=tol)
    assert bool(runs[0]["out"][C:2 * C].any())  # the quiet chunk
    part = [e[("partitioned", dtype)] for e in exchanged]
    assert all(torch.equal(r["out"], part[0]["out"]) for r in part)
    assert bool(torch.isfinite(part[0]["out"]).all()) and float(part[0]["out"].abs().sum()) > 0
