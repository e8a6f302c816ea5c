"""The fast CPU path: a small C++ library (``cpu_table.cpp``) loaded with ctypes.

One pass over the buffer with a vectorised compare; candidates are hashed into a cache-blocked table. Results
equal ``reference.py`` bit for bit (tests/test_kernels.py). Threading (torch's OpenMP pool or std::thread), the
build and its cache under ``$TORCH_EXTENSIONS_DIR/ds_dragonn_cpu/``: see docs/kernels.md. Without a compiler
:func:`available` is False and callers fall back to the reference.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from ..base import EMPTY_SLOT

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_table.cpp")
CXXFLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-math-errno"]

#: dtype codes of the C++ side
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}

#: Table building (speed only): bytes of table per partition of the cache-blocked path (0: default, 1 MiB;
#: -1: no blocking, atomic stores) and candidates per (thread, partition) bucket (0: default).
BLOCK_BYTES = 0
BUCKET_CAP = 0

#: Widest vector path of the table scan: "auto", "avx512", "avx2", "sse2" or "scalar" (clamped to what the CPU
#: has; speed only). Read at each call; default from ``DS_DRAGONN_CPU_ISA``.
ISA = os.environ.get("DS_DRAGONN_CPU_ISA", "auto")
ISA_CODES = {"auto": 0, "scalar": 1, "sse2": 2, "avx2": 3, "avx512": 4}

#: How the loaded library runs its threads: "openmp" (torch's pool) or "std::thread"; None before load().
THREADING: Optional[str] = None
#: The library file that load() loaded; None before.
LOADED_PATH: Optional[Path] = None

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None


def _cache_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "torch_extensions")
    return Path(root) / "ds_dragonn_cpu"


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _loaded_libgomp() -> list[str]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path, may contain spaces]
        if len(fields) == 6 and fields[5].startswith("/") and "/libgomp" in fields[5]:
            paths.add(fields[5])
    return sorted(paths)


def openmp_flags() -> list[str]:
    """``["-fopenmp"]`` when the build can share torch's OpenMP runtime, else ``[]``.

    Only when torch's parallel backend is OpenMP and exactly one ``libgomp.so.1*`` is loaded (the library then
    binds to it by soname: one thread pool). ``DS_DRAGONN_CPU_OPENMP=0`` forces std::thread.
    """
    if os.environ.get("DS_DRAGONN_CPU_OPENMP", "1") == "0":
        return []
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return []
    if len([p for p in _loaded_libgomp() if Path(p).name.startswith("libgomp.so.1")]) != 1:
        return []
    return ["-fopenmp"]


def library_path(cxx: str, extra_flags: Optional[list[str]] = None) -> Path:
    """Where the library built by ``cxx`` (with ``extra_flags``) from the current source lives in the cache."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256()
    flags = " ".join(CXXFLAGS + list(extra_flags or []))
    for part in (SOURCE.read_bytes(), flags.encode(), version.encode(), platform.machine().encode(),
                 _cpu_flags().encode()):
        h.update(part)
    return _cache_dir() / f"dragonn_cpu_{h.hexdigest()[:16]}.so"


def _build(cxx: str, out: Path, extra_flags: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *CXXFLAGS, *extra_flags, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder's copy is identical
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL:
    """The compiled library (built on first use). Raises RuntimeError when it cannot be built."""
    global _lib, _error, THREADING, LOADED_PATH
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise RuntimeError(_error)
        try:
            cxx = _compiler()
            if cxx is None:
                raise RuntimeError("no C++ compiler found (set CXX or install g++)")
            omp = openmp_flags()
            variants = [omp, []] if omp else [[]]
            for i, flags in enumerate(variants):
                try:
                    path = library_path(cxx, flags)
                    if not path.exists():
                        logger.info("building the DRAGONN CPU kernel: %s", path)
                        _build(cxx, path, flags)
                    lib = ctypes.CDLL(str(path))
                    break
                except Exception as err:  # noqa: BLE001 - the std::thread build is the fallback
                    if i + 1 == len(variants):
                        raise
                    logger.warning("DRAGONN CPU kernel: the OpenMP build failed (%s); using std::thread",
                                   str(err).splitlines()[0])
            THREADING, LOADED_PATH = ("openmp" if flags else "std::thread"), path
        except Exception as err:  # noqa: BLE001 - remembered and re-raised with the cause
            _error = f"DRAGONN CPU kernel unavailable: {err}"
            raise RuntimeError(_error) from err
        vp, i64, i32, u32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32, ctypes.c_float
        lib.dragonn_sample_kth.argtypes = [vp, i32, i64, i64, i64, u32, vp, i32]
        lib.dragonn_sample_kth.restype = f32
        lib.dragonn_build_table.argtypes = [vp, i32, i64, f32, i64, u32, i32, vp, i32, i64, i64, i32, vp]
        lib.dragonn_build_table.restype = i32
        lib.dragonn_gather.argtypes = [vp, i64, i32, vp, i32, vp, i32, vp, i32, vp]
        lib.dragonn_gather.restype = i64
        lib.dragonn_select_segments.argtypes = [vp, i32, i32, vp, vp, vp, vp, ctypes.c_uint64, vp, vp, vp, vp,
                                                i32, vp, vp, i32, i32, vp]
        lib.dragonn_select_segments.restype = i64
        lib.dragonn_isa.argtypes = [i32]
        lib.dragonn_isa.restype = i32
        lib.dragonn_sparse_update.argtypes = [vp, i32, vp, i32, i64, vp, i32, ctypes.c_double, vp, i32]
        lib.dragonn_sparse_update.restype = i32
        lib.dragonn_compensate.argtypes = [vp, vp, i32, i32, vp, vp, i32, ctypes.c_double, i32, i32]
        lib.dragonn_compensate.restype = i32
        lib.dragonn_segment_addresses.argtypes = [i32, vp, vp, i32, vp, i32, i64, vp, i32]
        lib.dragonn_segment_addresses.restype = None
        lib.dragonn_addr_update.argtypes = [i32, vp, i64, vp, i32, ctypes.c_double, vp, i32]
        lib.dragonn_addr_update.restype = i32
        _lib = lib
        return lib


def available() -> bool:
    """True when the library is (or can be) built and loaded on this machine."""
    try:
        load()
        return True
    except RuntimeError:
        return False


def _isa_code(isa: str) -> int:
    try:
        return ISA_CODES[isa.lower()]
    except KeyError:
        raise ValueError(f"unknown ISA {isa!r} for the DRAGONN CPU kernel; choose one of "
                         f"{', '.join(ISA_CODES)}") from None


def isa_in_use(isa: Optional[str] = None) -> str:
    """The scan path that ``isa`` (default: :data:`ISA`) resolves to on this CPU."""
    code = load().dragonn_isa(_isa_code(ISA if isa is None else isa))
    return next(name for name, c in ISA_CODES.items() if c == code)


def check_bounds(indices, numel: int) -> None:
    """Raise ValueError when a rank's CPU indices (a sequence of (c_r,) integer tensors) fall outside
    [0, numel): this library writes through raw addresses, so the host checks before any write."""
    for r, idx in enumerate(indices):
        if idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= numel:
                raise ValueError(f"rank {r} sent indices in [{lo}, {hi}], outside the bucket's [0, {numel}): "
                                 f"a corrupt exchange, or ranks reducing different buckets")


def supports(flat: torch.Tensor) -> bool:
    return flat.device.type == "cpu" and flat.dtype in DTYPE_CODES


def _check(flat: torch.Tensor) -> torch.Tensor:
    if not supports(flat):
        raise ValueError(f"the CPU kernel takes a CPU tensor of {sorted(str(d) for d in DTYPE_CODES)}, "
                         f"got {flat.dtype} on {flat.device}")
    return flat.contiguous()


def sample_kth(flat: torch.Tensor, num_samples: int, kk: int, seed: int) -> torch.Tensor:
    """The ``kk``-th largest finite magnitude of the stratified hashed sample (see ``dragonn.sample_positions``).

    Returns a 0-d float32 tensor; equals ``dragonn.sample_threshold(flat, ..., seed=seed)`` exactly.
    """
    flat = _check(flat)
    n = flat.numel()
    if not 1 <= kk <= num_samples <= n:
        raise ValueError(f"need 1 <= kk <= num_samples <= numel, got {kk}, {num_samples}, {n}")
    scratch = torch.empty(num_samples, dtype=torch.int32)
    thr = load().dragonn_sample_kth(flat.data_ptr(), DTYPE_CODES[flat.dtype], n, num_samples, kk,
                                    int(seed) & 0xFFFFFFFF, scratch.data_ptr(), torch.get_num_threads())
    return torch.tensor(thr, dtype=torch.float32)


def build_table(flat: torch.Tensor, threshold: torch.Tensor, capacity: int, seed: int, index_bits: int
                ) -> torch.Tensor:
    """Same contract as ``dragonn.build_table``; ``index_bits`` is ``dragonn.index_bits(numel)``."""
    return _build_table(_check(flat), threshold, capacity, seed, index_bits, with_values=False)[0]


def _build_table(flat: torch.Tensor, threshold: torch.Tensor, capacity: int, seed: int, index_bits: int,
                 with_values: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(table, per-slot values or None) for a checked ``flat``; values only where the library filled them."""
    thr = float(threshold)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if thr != thr:  # NaN threshold: the reference's comparisons are all False
        return torch.full((capacity,), EMPTY_SLOT, dtype=torch.int64), None
    table = torch.empty(capacity, dtype=torch.int64)
    vtab = torch.empty(capacity, dtype=flat.dtype) if with_values else None
    filled = load().dragonn_build_table(flat.data_ptr(), DTYPE_CODES[flat.dtype], flat.numel(), thr, capacity,
                                        int(seed) & 0xFFFFFFFF, index_bits, table.data_ptr(),
                                        torch.get_num_threads(), BLOCK_BYTES, BUCKET_CAP, _isa_code(ISA),
                                        None if vtab is None else vtab.data_ptr())
    return table, (vtab if filled else None)


def gather_table(flat: torch.Tensor, table: torch.Tensor, index_bits: int, index_dtype: torch.dtype,
                 vtab: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``dragonn.gather_table`` (valid slots in slot order).

    ``vtab``: per-slot values filled by the table build (see :func:`select`); None reads ``flat``.
    """
    flat = _check(flat)
    table = table.contiguous()
    m = table.numel()
    idx = torch.empty(m, dtype=index_dtype)
    vals = torch.empty(m, dtype=flat.dtype)
    count = load().dragonn_gather(table.data_ptr(), m, index_bits, flat.data_ptr(), flat.element_size(),
                                  idx.data_ptr(), int(index_dtype == torch.int64), vals.data_ptr(),
                                  torch.get_num_threads(), None if vtab is None else vtab.data_ptr())
    return idx[:count], vals[:count]


def select(flat: torch.Tensor, threshold: torch.Tensor, capacity: int, seed: int, index_bits: int,
           index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_table(flat, build_table(flat, threshold, capacity, seed, ...))`` in one go.

    Also records each slot's winning value, so the gather reads values in slot order. Same result as the two
    calls, bit for bit (tests/test_kernels.py).
    """
    flat = _check(flat)
    table, vtab = _build_table(flat, threshold, capacity, seed, index_bits, with_values=True)
    return gather_table(flat, table, index_bits, index_dtype, vtab)


def select_segments(flat: torch.Tensor, offsets: torch.Tensor, plan: torch.Tensor, seed: int,
                    index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor DRAGONN selection of every segment of ``flat`` in one call.

    Args:
        flat: (n,) CPU buffer. offsets: (nseg + 1,) int64 segment offsets.
        plan: (3, nseg) or (4, nseg) int64: per segment the sample size (0: threshold 0, every nonzero element),
            the rank of the threshold in the sample, the table slots (0: nothing kept), and (fourth row, optional)
            the most pairs the segment keeps (0: no cap): its largest magnitudes, ties to the earlier table slot,
            as ``base.trim`` (chunk-wise selection, ``compress/chunks.py``).
        seed: the call's seed; segment s uses ``base.segment_seed(seed, s)``.
        index_dtype: int32 or int64 of the output indices (bucket positions).
    Returns:
        (indices, values, thresholds (nseg,) float32): equal to the concatenation of :func:`select` on each
        slice with its threshold from :func:`sample_kth`, each cut to its cap (tests/test_selection.py,
        tests/test_chunked.py).
    """
    flat = _check(flat)
    plan = plan.contiguous()
    caps = plan[3] if plan.shape[0] > 3 else None
    nseg = offsets.numel() - 1
    total = int(plan[2].sum())
    table = torch.empty(total, dtype=torch.int64)
    vtab = torch.empty(total, dtype=flat.dtype)
    scratch = torch.empty(max(int(plan[0].max()) if nseg else 0, 1), dtype=torch.int32)
    idx = torch.empty(total, dtype=index_dtype)
    vals = torch.empty(total, dtype=flat.dtype)
    thr = torch.empty(nseg, dtype=torch.float32)
    count = load().dragonn_select_segments(
        flat.data_ptr(), DTYPE_CODES[flat.dtype], nseg, offsets.data_ptr(), plan[0].data_ptr(), plan[1].data_ptr(),
        plan[2].data_ptr(), int(seed) & 0xFFFF_FFFF_FFFF_FFFF, table.data_ptr(), vtab.data_ptr(), scratch.data_ptr(),
        idx.data_ptr(), int(index_dtype == torch.int64), vals.data_ptr(), thr.data_ptr(), torch.get_num_threads(),
        _isa_code(ISA), None if caps is None else caps.data_ptr())
    return idx[:count], vals[:count], thr


# -- sparse updates (decode and error-feedback commit) ----------------------------------------------------
#: dtypes :func:`sparse_update` handles (fp16 goes through torch's index ops)
SPARSE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_SPARSE_MODES = {"set": 0, "add": 1, "zero": 2, "gather_scaled": 3}


def sparse_supported(dst: torch.Tensor, indices: torch.Tensor) -> bool:
    """True when :func:`sparse_update` takes ``dst`` and ``indices`` and the library loads."""
    return (dst.device.type == "cpu" and dst.dtype in SPARSE_DTYPES and dst.is_contiguous()
            and indices.device.type == "cpu" and indices.dtype in (torch.int32, torch.int64) and available())


def sparse_update(dst: torch.Tensor, indices: torch.Tensor, mode: str, src: Optional[torch.Tensor] = None,
                  scale: float = 1.0) -> Optional[torch.Tensor]:
    """Update ``dst`` at ``indices`` with prefetched scattered accesses (same results as torch's index ops).

    Args:
        dst: (n,) contiguous CPU tensor of fp32, bf16 or fp64.
        indices: (c,) int32/int64 positions in [0, n); distinct for ``"add"``.
        mode: ``"set"`` (``dst[idx] = src``), ``"add"`` (``dst.index_add_(0, idx, src)``), ``"zero"``
            (``dst[idx] = 0``) or ``"gather_scaled"`` (returns ``dst[idx] * scale`` as a new (c,) tensor).
        src: (c,) values of ``dst``'s dtype, for ``"set"`` and ``"add"``.
    Returns:
        The (c,) tensor for ``"gather_scaled"``, else None.
    Raises:
        ValueError: unsupported dtype, device or index dtype, or ``src`` of the wrong size or dtype.
    """
    if not sparse_supported(dst, indices):
        raise ValueError(f"sparse_update takes a contiguous CPU tensor of {SPARSE_DTYPES} and int32/int64 "
                         f"CPU indices, got {dst.dtype} on {dst.device}, indices {indices.dtype}")
    indices = indices.contiguous()
    code, src, tmp = _update_operands("sparse_update", mode, dst.dtype, indices.numel(), src)
    load().dragonn_sparse_update(dst.data_ptr(), DTYPE_CODES[dst.dtype], indices.data_ptr(),
                                 int(indices.dtype == torch.int64), indices.numel(),
                                 None if src is None else src.data_ptr(), code,
                                 float(scale), None if tmp is None else tmp.data_ptr(), torch.get_num_threads())
    return tmp


def _update_operands(fn: str, mode: str, dtype: torch.dtype, count: int, src: Optional[torch.Tensor]):
    code = _SPARSE_MODES[mode]
    if code in (0, 1):
        if src is None or src.numel() != count or src.dtype != dtype:
            raise ValueError(f"{fn}({mode!r}) needs {count} values of {dtype}")
        src = src.contiguous()
    else:
        src = None
    tmp = torch.empty(count, dtype=dtype) if code == 3 else None
    return code, src, tmp


def compensate_supported(dst: torch.Tensor, tensors) -> bool:
    """True when :func:`compensate` takes ``dst`` (fp32/fp64 CPU) and ``tensors`` (contiguous CPU, one dtype)."""
    if dst.device.type != "cpu" or not dst.is_contiguous() or not tensors:
        return False
    dt = tensors[0].dtype
    ok = {torch.float32: (torch.float32, torch.bfloat16), torch.float64: (torch.float64,)}.get(dst.dtype, ())
    return dt in ok and all(t.dtype == dt and t.device.type == "cpu" and t.is_contiguous() for t in tensors) \
        and available()


def compensate(dst: torch.Tensor, tensors, alpha: float = 1.0, zero_inputs: bool = False,
               base: torch.Tensor | None = None) -> None:
    """``dst = base + alpha × cat([t.flatten() for t in tensors])`` (``base`` None: ``dst`` itself, i.e.
    ``dst +=`` in place), without the concatenation; one pass.

    Args:
        dst: (n,) contiguous fp32 (gradients fp32 or bf16) or fp64 (gradients fp64) CPU tensor,
            n = total elements of ``tensors``.
        tensors: contiguous CPU tensors of one dtype, in bucket order.
        alpha: scale of the gradients (alpha == 1 rounds once, like ``Tensor.add_``).
        zero_inputs: also set every element of ``tensors`` to 0, in the same pass.
        base: optional (n,) contiguous CPU tensor of ``dst``'s dtype, read instead of ``dst`` (unchanged).
    Raises:
        ValueError: unsupported dtypes/devices, or sizes that do not add up to n.
    """
    if base is not None and (base.dtype != dst.dtype or base.shape != dst.shape or base.device.type != "cpu"
                             or not base.is_contiguous()):
        raise ValueError(f"compensate: base {tuple(base.shape)} {base.dtype} does not match dst "
                         f"{tuple(dst.shape)} {dst.dtype}")
    if not compensate_supported(dst, tensors):
        raise ValueError("compensate takes a contiguous fp32/fp64 CPU buffer and contiguous CPU gradients of "
                         "fp32/bf16 (fp32 buffer) or fp64 (fp64 buffer)")
    lens = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    if int(lens.sum()) != dst.numel():
        raise ValueError(f"gradients hold {int(lens.sum())} elements, the buffer {dst.numel()}")
    ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    src = dst if base is None else base
    rc = load().dragonn_compensate(dst.data_ptr(), src.data_ptr(), DTYPE_CODES[dst.dtype], len(tensors), ptrs,
                                   lens.data_ptr(),
                                   DTYPE_CODES[tensors[0].dtype], float(alpha), int(zero_inputs),
                                   torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"compensate: unsupported dtypes {dst.dtype} += {tensors[0].dtype}")


# -- sparse updates addressed through a bucket's gradient tensors -----------------------------------------
def segments_supported(tensors) -> bool:
    """True when :func:`segment_addresses` / :func:`addr_update` take ``tensors``: contiguous CPU tensors of one
    dtype, fp32 or bf16, and the library loads."""
    if not tensors:
        return False
    dt = tensors[0].dtype
    return dt in (torch.float32, torch.bfloat16) and all(
        t.dtype == dt and t.device.type == "cpu" and t.is_contiguous() for t in tensors) and available()


def segment_addresses(tensors, indices: torch.Tensor) -> torch.Tensor:
    """Byte addresses of bucket positions ``indices`` inside ``tensors`` (the bucket is their concatenation).

    Args:
        tensors: the bucket's tensors (see :func:`segments_supported`); they must stay alive while the
            addresses are used.
        indices: (c,) int32/int64 positions in [0, total elements).
    Returns:
        (c,) int64 addresses, for :func:`addr_update`.
    """
    lens = [t.numel() for t in tensors]
    offsets = torch.tensor([0] + lens, dtype=torch.int64).cumsum_(0)
    ptrs = torch.tensor([t.data_ptr() for t in tensors] + [0], dtype=torch.int64)
    indices = indices.contiguous()
    out = torch.empty(indices.numel(), dtype=torch.int64)
    load().dragonn_segment_addresses(len(tensors), ptrs.data_ptr(), offsets.data_ptr(), tensors[0].element_size(),
                                     indices.data_ptr(), int(indices.dtype == torch.int64), indices.numel(),
                                     out.data_ptr(), torch.get_num_threads())
    return out


def addr_update(dtype: torch.dtype, addresses: torch.Tensor, mode: str, src: Optional[torch.Tensor] = None,
                scale: float = 1.0) -> Optional[torch.Tensor]:
    """:func:`sparse_update`'s ``"set"``, ``"add"`` (distinct addresses) and ``"gather_scaled"`` on addresses
    from :func:`segment_addresses` of fp32 or bf16 tensors."""
    code, src, tmp = _update_operands("addr_update", mode, dtype, addresses.numel(), src)
    rc = load().dragonn_addr_update(DTYPE_CODES[dtype], addresses.data_ptr(), addresses.numel(),
                                    None if src is None else src.data_ptr(), code,
                                    float(scale), None if tmp is None else tmp.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"addr_update: unsupported dtype {dtype} or mode {mode!r}")
    return tmp
