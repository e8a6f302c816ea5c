"""The fast DRAGONN kernels against the pure-PyTorch reference, element by element.

``cpu``: the C++ library (built on first use, ~2 s). ``triton``: the Triton kernels under
``TRITON_INTERPRET=1`` on CPU tensors (small sizes: the interpreter runs numpy per program); on a CUDA
machine the same comparisons run on the GPU (``launch/gpu_check.sh``). Nothing here asserts on timing.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_dragonn.compress import DragonnCompressor
from ds_dragonn.compress import dragonn as ref
from ds_dragonn.compress.base import magnitude
from ds_dragonn.compress.kernels import (build_table_fast, cpu_table, gather_table_fast, resolve_kernel,
                                         sample_threshold_fast, select_fast, triton_available)

REPO = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
CUDA = torch.cuda.is_available()

if not os.environ.get("TRITON_INTERPRET") and not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a Triton kernel is launched, so setting it here works

need_cpu = pytest.mark.skipif(not cpu_table.available(), reason="no C++ compiler: the CPU kernel cannot be built")
need_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install triton)")


def device_for(kernel: str) -> str:
    return "cuda" if kernel == "triton" and CUDA else "cpu"


def make(n: int, dtype: torch.dtype, device: str = "cpu", specials: bool = True, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3)
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    if specials and n >= 16:
        x[1], x[6], x[n - 1] = float("nan"), -0.0, float("nan")
    return x.to(dtype).to(device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including NaN payloads (torch.equal treats NaN != NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().reshape(-1).view(torch.uint8),
                                                                     b.cpu().reshape(-1).view(torch.uint8))


def check_all_steps(x: torch.Tensor, kernel: str, density: float, num_samples: int, capacity: int, seed: int):
    want_thr = ref.sample_threshold(x.cpu(), density, num_samples, seed=seed)
    got_thr = sample_threshold_fast(x, density, num_samples, seed, kernel)
    assert same_bits(got_thr.reshape(()), want_thr.reshape(())), (float(got_thr), float(want_thr))
    want = ref.build_table(x.cpu(), want_thr, capacity, seed ^ 0x5A5A)
    got = build_table_fast(x, want_thr.to(x.device), capacity, seed ^ 0x5A5A, kernel)
    assert got.dtype == torch.int64 and got.shape == (capacity,)
    diff = (got.cpu() != want).nonzero().squeeze(1)
    assert diff.numel() == 0, f"{diff.numel()} slots differ, first {diff[:5].tolist()}"
    wi, wv = ref.gather_table(x.cpu(), want)
    gi, gv = gather_table_fast(x, got, kernel)
    assert torch.equal(gi.cpu(), wi) and same_bits(gv, wv)
    # the fused path (values carried through the table build on the CPU kernel)
    si, sv = select_fast(x, want_thr.to(x.device), capacity, seed ^ 0x5A5A, kernel)
    assert torch.equal(si.cpu(), wi) and same_bits(sv, wv)


SIZES = [1, 2, 7, 99, 100, 1001, 4099]
KERNELS = [pytest.param("cpu", marks=need_cpu), pytest.param("triton", marks=need_triton)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_equals_reference_small(kernel, dtype, n):
    x = make(n, dtype, device_for(kernel), seed=n)
    k = max(1, math.ceil(0.01 * n))
    for capacity in (max(1, 4 * k), n, n + 3):  # hashed, direct at m == n, direct with spare slots
        check_all_steps(x, kernel, 0.01, min(n, 64), capacity, seed=n + 11)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_equals_reference_collisions_and_seeds(kernel):
    """A tiny table: most candidates collide, so the winner rule (larger key) is exercised heavily."""
    x = make(3000, torch.float32, device_for(kernel))
    for seed in (0, 1, 0xFFFFFFFF, 2**31 + 5):
        check_all_steps(x, kernel, 0.3, 3000, 7, seed)
    tied = torch.ones(3000, device=x.device)  # equal magnitudes: ties go to the larger index
    check_all_steps(tied, kernel, 0.1, 512, 13, 3)


@need_cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [(1 << 20) + 7, 1 << 21])
def test_cpu_kernel_equals_reference_large(dtype, n):
    x = make(n, dtype)
    k = math.ceil(0.01 * n)
    check_all_steps(x, "cpu", 0.01, math.ceil(0.01 * n), 4 * k, seed=n)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bad", [float("inf"), -float("inf")])
def test_infinities(kernel, bad):
    assert magnitude(torch.tensor([bad])).item() == math.inf
    x = make(2000, torch.float32, device_for(kernel))
    x[[3, 500, 1999]] = bad
    check_all_steps(x, kernel, 0.01, 256, 80, 5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_threshold_edge_values(kernel):
    """Threshold 0 keeps every nonzero, +Inf keeps only non-finite entries, NaN keeps nothing."""
    x = make(1000, torch.bfloat16, device_for(kernel))
    for thr in (0.0, -1.0, float("inf"), float("nan"), 1e-30, 0.5):
        t = torch.tensor(thr)
        want = ref.build_table(x.cpu(), t, 64, 9)
        got = build_table_fast(x, t.to(x.device), 64, 9, kernel)
        assert torch.equal(got.cpu(), want), thr


@need_cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 5, 99, 1001, 65_537, (1 << 20) + 3])  # 2^20: the cache-blocked table
def test_compressor_cpu_equals_reference(dtype, n):
    x = make(n, dtype, seed=3)
    a = DragonnCompressor(0.01, min_sample=128, kernel="reference").compress(x, seed=n)
    b = DragonnCompressor(0.01, min_sample=128, kernel="cpu").compress(x, seed=n)
    assert torch.equal(a.indices, b.indices) and same_bits(a.values, b.values)
    assert same_bits(a.threshold, b.threshold) and (a.k, a.capacity) == (b.k, b.capacity)


@need_cpu
def test_auto_uses_cpu_kernel_and_rejects_impossible_choices():
    x = torch.randn(100)
    assert resolve_kernel("auto", x) == "cpu"
    assert resolve_kernel("reference", x) == "reference"
    with pytest.raises(ValueError, match="unknown DRAGONN kernel"):
        DragonnCompressor(0.01, kernel="fast")
    with pytest.raises(ValueError, match="cpu"):
        resolve_kernel("cpu", torch.zeros(3, dtype=torch.int32))


def test_sample_positions_are_stratified():
    for n, s in [(10, 10), (1000, 7), (12_345, 1024), (2**20 + 3, 10_486)]:
        pos = ref.sample_positions(n, s, seed=42)
        assert pos.shape == (s,) and int(pos[0]) >= 0 and int(pos[-1]) < n
        assert bool((pos[1:] > pos[:-1]).all())
        j = torch.arange(s)
        assert bool((pos >= j * n // s).all()) and bool((pos < (j + 1) * n // s).all())
    assert not torch.equal(ref.sample_positions(10_000, 100, 1), ref.sample_positions(10_000, 100, 2))


@need_cpu
def test_cpu_library_rebuilds_into_a_fresh_cache(tmp_path):
    """A fresh TORCH_EXTENSIONS_DIR: the library builds there (what CI does on its first run)."""
    code = ("import torch; from ds_dragonn.compress.kernels import cpu_table as c; c.load(); "
            "assert c.LOADED_PATH == c.library_path(c._compiler(), c.openmp_flags()); print(c.LOADED_PATH)")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.exists() and tmp_path in path.parents


def test_bench_compress_quick_smoke(tmp_path):
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "bench_compress.py"), "--quick", "--sizes", "14", "15", "--repeat", "2", "--warmup", "1",
                           "--json", str(out), "--plot", str(png)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    recs = json.loads(out.read_text())
    methods = {r["method"] for r in recs}
    assert {"floor_sum", "topk", "dgc", "randomk", "dragonn_reference"} <= methods
    keys = {"method", "numel", "density", "dtype", "device", "median_ms", "floor_ms", "topk_mass_captured",
            "rel_error", "kept_over_k"}
    for r in recs:
        assert keys <= set(r)
        assert r["median_ms"] > 0
    topk = [r for r in recs if r["method"] == "topk"]
    assert all(abs(r["topk_mass_captured"] - 1.0) < 1e-6 for r in topk)
    assert png.stat().st_size > 1000


@need_cpu
@pytest.mark.parametrize("block_bytes,bucket_cap", [(0, 0), (-1, 0), (64, 0), (4096, 3), (1 << 14, 1), (8, 1 << 20)])
@pytest.mark.parametrize("n", [3000, 2048 * 33 + 17, (1 << 17) + 2047])
def test_cpu_blocked_table_partitions_and_overflow(monkeypatch, block_bytes, bucket_cap, n):
    """The cache-blocked table path: many partitions (tiny block_bytes), full buckets (tiny bucket_cap,
    which spills full buckets into the table with atomic max), blocking off (-1), and sizes off the scan's chunk boundaries."""
    monkeypatch.setattr(cpu_table, "BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(cpu_table, "BUCKET_CAP", bucket_cap)
    x = make(n, torch.float32, seed=n)
    for density, capacity in ((0.01, 4 * math.ceil(0.01 * n)), (0.3, 7), (0.05, 1000), (0.01, n - 1)):
        check_all_steps(x, "cpu", density, min(n, 4096), capacity, seed=n + capacity)
    thr0 = torch.tensor(0.0)  # every nonzero is a candidate: far more than the table holds
    want = ref.build_table(x, thr0, 513, 4)
    assert torch.equal(build_table_fast(x, thr0, 513, 4, "cpu"), want)


@need_cpu
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_kernel_thread_counts_and_gather_blocks(threads):
    """Thread splits of the sample, the table and the gather; table sizes around the gather's blocks."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = (1 << 16) + 511
        x = make(n, torch.float32, seed=threads)
        for capacity in (511, 512, 513, 1025, 65_537 * 2 + 3):
            check_all_steps(x, "cpu", 0.02, 40_000, capacity, seed=capacity)
    finally:
        torch.set_num_threads(old)


@need_cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_sample_strata(dtype):
    """Stratum bounds computed incrementally: sample sizes from 1 to n, lengths q and q + 1, threads."""
    n = (1 << 20) + 7
    x = make(n, dtype, seed=5)
    for s in (1, 2, 63, 64, 65, 1000, (1 << 15) - 1, (1 << 15) + 5, n // 3, n // 2 + 1, n - 1, n):
        for kk_density in (0.001, 0.01, 0.03, 0.5):  # per-thread heaps (kk <= s/32) and a full nth_element
            want = ref.sample_threshold(x, kk_density, s, seed=s * 7 + 1)
            got = sample_threshold_fast(x, kk_density, s, s * 7 + 1, "cpu")
            assert same_bits(got.reshape(()), want.reshape(())), (s, kk_density)


@need_cpu
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_bucket_spill_all_candidates(threads, dtype):
    """Threshold far below the k-th largest with the default bucket sizes: most elements are candidates,
    the per-thread buckets fill up and spill into the table with atomic max during the scan (several
    threads into one partition). Ties (equal magnitudes) resolve to the larger index, as in the reference."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = (1 << 18) + 77
        x = make(n, dtype, seed=threads)
        ones = torch.ones(n, dtype=dtype)
        for data, thr, capacity in ((x, 0.0, (1 << 15) + 3), (ones, 1.0, 1 << 16), (x, 1e-6, 40_000),
                                    (ones, 0.0, (1 << 15) * 3 + 1)):
            t = torch.tensor(thr)
            want = ref.build_table(data, t, capacity, 21)
            got = build_table_fast(data, t, capacity, 21, "cpu")
            diff = (got != want).nonzero().squeeze(1)
            assert diff.numel() == 0, f"{diff.numel()} slots differ, first {diff[:5].tolist()}"
            wi, wv = ref.gather_table(data, want)
            gi, gv = gather_table_fast(data, got, "cpu")
            assert torch.equal(gi, wi) and same_bits(gv, wv)
            si, sv = select_fast(data, t, capacity, 21, "cpu")  # spilled: values read from data
            assert torch.equal(si, wi) and same_bits(sv, wv)
    finally:
        torch.set_num_threads(old)


ISAS = ["avx512", "avx2", "sse2", "scalar"]


@need_cpu
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_scan_paths_equal_reference(monkeypatch, isa, dtype):
    """Every vector path of the scan this CPU has (forced with cpu_table.ISA / DS_DRAGONN_CPU_ISA), at
    sizes off each path's block boundaries, with blocking on, off and spilling, against the reference."""
    if cpu_table.isa_in_use(isa) != isa:
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setattr(cpu_table, "ISA", isa)
    for n in (15, 33, 2047, 2048 * 3 + 31, (1 << 16) + 2048 + 17):
        x = make(n, dtype, seed=n)
        for density, capacity in ((0.01, 4 * math.ceil(0.01 * n)), (0.3, 7), (0.01, n)):
            check_all_steps(x, "cpu", density, min(n, 4096), capacity, seed=n + capacity)
    n = (1 << 16) + 2048 + 17
    x = make(n, dtype, seed=1)
    for block_bytes, bucket_cap in ((-1, 0), (4096, 5)):
        monkeypatch.setattr(cpu_table, "BLOCK_BYTES", block_bytes)
        monkeypatch.setattr(cpu_table, "BUCKET_CAP", bucket_cap)
        for thr in (0.0, 0.5):
            t = torch.tensor(thr)
            assert torch.equal(build_table_fast(x, t, 3001, 8, "cpu"), ref.build_table(x, t, 3001, 8)), thr


@need_cpu
def test_cpu_threading_matches_torch_runtime():
    """OpenMP exactly when the process holds one libgomp.so.1 and torch runs on OpenMP (then one pool)."""
    cpu_table.load()
    assert cpu_table.THREADING == ("openmp" if cpu_table.openmp_flags() else "std::thread")
    if cpu_table.THREADING == "openmp":
        # ours bound to torch's runtime by soname: still one libgomp.so.1 in the process
        names = [p.rsplit("/", 1)[1] for p in cpu_table._loaded_libgomp()]
        assert len([name for name in names if name.startswith("libgomp.so.1")]) == 1


@need_cpu
def test_cpu_std_thread_build_equals_reference():
    """The std::thread build (DS_DRAGONN_CPU_OPENMP=0) through the threaded and blocked-table tests."""
    env = dict(os.environ, DS_DRAGONN_CPU_OPENMP="0", DS_ACCELERATOR="cpu")
    tests = "thread_counts or spill or blocked_table or threading_matches"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "deselected" in out.stdout


@need_cpu
def test_cpu_isa_knob_from_environment():
    code = ("from ds_dragonn.compress.kernels import cpu_table as c; print(c.ISA, c.isa_in_use())\n"
            "try: c.isa_in_use('mmx')\nexcept ValueError: print('rejected')")
    env = dict(os.environ, DS_DRAGONN_CPU_ISA="scalar", DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["scalar", "scalar", "rejected"]
