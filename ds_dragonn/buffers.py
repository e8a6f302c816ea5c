"""Persistent per-bucket buffers (residuals, decode buffers), allocated once and reused every step.

On Linux CPU buffers of 4 MiB and more ask for transparent huge pages (``madvise(MADV_HUGEPAGE)``, which
works in the kernel's default ``madvise`` mode): the residual commit and the decode touch ~k scattered
positions of a buffer of hundreds of MB, where 4 KiB pages miss the TLB on nearly every access
(measured at 24 M fp32 elements, 1 thread: scatter-add of 242 k pairs 4.3 → 3.2 ms).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MIN_BYTES = 4 << 20


@functools.lru_cache(maxsize=None)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def persistent_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled (numel,) tensor meant to live for the whole run (huge pages where available)."""
    t = torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * t.element_size()
    madvise = _madvise() if t.device.type == "cpu" and nbytes >= _MIN_BYTES else None
    if madvise is not None:
        lo = -(-t.data_ptr() // _HUGE) * _HUGE
        hi = (t.data_ptr() + nbytes) // _HUGE * _HUGE
        if hi > lo:
            madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing but speed
    return t.zero_()
