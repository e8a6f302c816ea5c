"""Fast implementations of the DRAGONN selection steps, and the dispatcher that picks one.

``reference`` (``ds_dragonn.compress.reference``), ``cpu`` (``cpu_table``, the C++ library) and ``triton``
(``triton_table``, CUDA; CPU under ``TRITON_INTERPRET=1``) give identical results for the same input, threshold and
seed (tests/test_kernels.py). ``auto`` resolves per buffer: ``triton`` for CUDA tensors when Triton imports, ``cpu``
for CPU tensors when the C++ library builds, else ``reference``. See docs/kernels.md.
"""
from __future__ import annotations

import functools
import os

import torch

from . import cpu_table
from .. import reference
from ..base import index_dtype, target_k

KERNELS = ("auto", "reference", "cpu", "triton")


def check_kernel(kernel: str) -> str:
    """Validate a kernel name (raises ValueError naming the choices)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown DRAGONN kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel == "triton" and not triton_available():
        raise ValueError("kernel 'triton' needs the triton package (pip install triton)")
    return kernel


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_kernel(kernel: str, flat: torch.Tensor) -> str:
    """The concrete implementation for ``flat`` ("reference", "cpu" or "triton").

    Raises:
        ValueError: an explicit kernel cannot run on this buffer (e.g. ``cpu`` for a CUDA tensor,
            ``triton`` for a CPU tensor without ``TRITON_INTERPRET=1``).
    """
    if kernel == "reference":
        return kernel
    dev = flat.device.type
    if kernel == "auto":
        if dev == "cuda" and flat.dtype in TRITON_DTYPES and triton_available():
            return "triton"
        if cpu_table.supports(flat) and cpu_table.available():
            return "cpu"
        return "reference"
    if kernel == "cpu":
        if not cpu_table.supports(flat):
            raise ValueError(f"kernel 'cpu' takes CPU tensors of fp32/fp16/bf16/fp64, got {flat.dtype} on {dev}")
        cpu_table.load()  # raises RuntimeError with the build error
        return kernel
    if kernel == "triton":
        if flat.dtype not in TRITON_DTYPES:
            raise ValueError(f"kernel 'triton' takes fp32/fp16/bf16/fp64 buffers, got {flat.dtype}")
        if dev != "cuda" and not (dev == "cpu" and triton_interpret()):
            raise ValueError(f"kernel 'triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU), got {dev}")
        return kernel
    raise ValueError(f"unknown DRAGONN kernel {kernel!r}; choose one of {', '.join(KERNELS)}")


TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def sample_threshold_fast(flat: torch.Tensor, density: float, num_samples: int, seed: int,
                          kernel: str = "auto") -> torch.Tensor:
    """``reference.sample_threshold(flat, density, num_samples, seed=seed)`` by the chosen kernel."""
    s = min(num_samples, flat.numel())
    return sample_kth_fast(flat, s, target_k(s, density), seed, kernel)


def sample_kth_fast(flat: torch.Tensor, num_samples: int, kk: int, seed: int, kernel: str = "auto") -> torch.Tensor:
    """``reference.sample_kth(flat, num_samples, kk, seed)`` by the chosen kernel: 0-d float32."""
    kernel = resolve_kernel(kernel, flat)
    n = flat.numel()
    s = min(num_samples, n)
    if kernel == "cpu":
        return cpu_table.sample_kth(flat, s, kk, seed)
    if kernel == "triton" and s < n:
        from . import triton_table
        mag = triton_table.sample_magnitudes(flat, s, seed)
        return torch.topk(mag, kk, sorted=False).values.min()
    return reference.sample_kth(flat, s, kk, seed)


def build_table_fast(flat: torch.Tensor, threshold: torch.Tensor, capacity: int, seed: int,
                     kernel: str = "auto") -> torch.Tensor:
    """``reference.build_table`` by the chosen kernel: triton on CUDA, the C++ library on CPU, else reference."""
    kernel = resolve_kernel(kernel, flat)
    if kernel == "cpu":
        return cpu_table.build_table(flat, threshold, capacity, seed, reference.index_bits(flat.numel()))
    if kernel == "triton":
        from . import triton_table
        return triton_table.build_table(flat, threshold, capacity, seed)
    return reference.build_table(flat, threshold, capacity, seed)


def gather_table_fast(flat: torch.Tensor, table: torch.Tensor, kernel: str = "auto"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.gather_table`` (valid slots, in slot order) by the chosen kernel."""
    kernel = resolve_kernel(kernel, flat)
    if kernel == "cpu":
        n = flat.numel()
        return cpu_table.gather_table(flat, table, reference.index_bits(n), index_dtype(n))
    return reference.gather_table(flat, table)


def select_fast(flat: torch.Tensor, threshold: torch.Tensor, capacity: int, seed: int, kernel: str = "auto"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_table_fast(flat, build_table_fast(...))``: on the CPU kernel one fused call (no scattered reads
    of ``flat`` for the values); identical results."""
    kernel = resolve_kernel(kernel, flat)
    if kernel == "cpu":
        n = flat.numel()
        return cpu_table.select(flat, threshold, capacity, seed, reference.index_bits(n), index_dtype(n))
    return gather_table_fast(flat, build_table_fast(flat, threshold, capacity, seed, kernel), kernel)


__all__ = ["KERNELS", "check_kernel", "resolve_kernel", "triton_available", "sample_threshold_fast", "sample_kth_fast",
           "build_table_fast", "gather_table_fast", "select_fast"]
