"""Sparse updates of a dense buffer at scattered positions, shared by decode and error feedback.

Each function has one meaning and two implementations with identical results: the CPU library's
prefetched loops (``compress/kernels/cpu_table``: fp32, bf16, fp64 CPU buffers) and torch's index ops
(every other case: CUDA, fp16, or no C++ compiler). ``indices`` are (c,) int32/int64 positions.
"""
from __future__ import annotations

import torch

from .compress.kernels import cpu_table


def _fast(dst: torch.Tensor, indices: torch.Tensor) -> bool:
    return indices.numel() > 0 and cpu_table.sparse_supported(dst, indices)


def set_(dst: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``dst[indices] = values`` (values cast to dst's dtype; duplicate positions must carry equal values)."""
    values = values.to(dst.dtype)
    if _fast(dst, indices):
        cpu_table.sparse_update(dst, indices, "set", values)
    elif indices.numel():
        dst.index_put_((indices.to(dst.device),), values.to(dst.device))


def add_(dst: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``dst.index_add_(0, indices, values)`` for distinct ``indices`` (values cast to dst's dtype)."""
    values = values.to(device=dst.device, dtype=dst.dtype)
    if _fast(dst, indices):
        cpu_table.sparse_update(dst, indices, "add", values)
    elif indices.numel():
        dst.index_add_(0, indices.to(dst.device), values)


def zero_(dst: torch.Tensor, indices: torch.Tensor) -> None:
    """``dst[indices] = 0``."""
    if _fast(dst, indices):
        cpu_table.sparse_update(dst, indices, "zero")
    elif indices.numel():
        dst.index_put_((indices.to(dst.device),), torch.zeros((), dtype=dst.dtype, device=dst.device))


def gather_scaled(dst: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """A new (c,) tensor ``dst[indices] * scale`` (computed as ``Tensor.mul_(scale)`` does)."""
    if _fast(dst, indices):
        return cpu_table.sparse_update(dst, indices, "gather_scaled", scale=scale)
    return dst.index_select(0, indices.to(dst.device)).mul_(scale)
