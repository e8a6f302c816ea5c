"""The memory operations of the data path, shared by error feedback, decode and the exchanges: sparse
updates of a dense buffer at scattered positions, the compensation pass, and the decode straight into a
bucket's own tensors.

This is the one place that chooses between the two implementations, with identical results: the CPU
library's prefetched loops (``compress/kernels/cpu_table``: fp32, bf16, fp64 CPU buffers) and torch's
ops (every other case: CUDA, fp16, or no C++ compiler). ``indices`` are (c,) int32/int64 positions.
"""
from __future__ import annotations

from typing import Optional, Sequence

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


def compensate_fast(buf: torch.Tensor, tensors: Sequence[torch.Tensor], prescale: float, zero_inputs: bool,
                    base: Optional[torch.Tensor] = None) -> bool:
    """``buf = (base if given else buf) + prescale × cat(tensors)`` in one pass of the CPU library, also
    zeroing ``tensors`` if ``zero_inputs``. Returns False, having done nothing, where the library does not
    serve these tensors (the caller then runs torch's foreach ops)."""
    if not cpu_table.compensate_supported(buf, tensors):
        return False
    cpu_table.compensate(buf, tensors, prescale, zero_inputs, base=base)
    return True


def can_decode_into(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`decode_into` serves these tensors (contiguous CPU fp32 or bf16)."""
    return cpu_table.segments_supported(tensors)


def decode_into(tensors: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                postscale: float = 1.0) -> None:
    """Add each list's ``values`` at bucket positions ``indices`` straight into ``tensors`` (the bucket's
    tensors in order, read as one flat buffer), then multiply the touched positions by ``postscale``.
    Only where :func:`can_decode_into`; values are cast to the tensors' dtype."""
    tensors = list(tensors)
    dtype = tensors[0].dtype
    addrs = []
    for idx, val in zip(indices, values):
        if idx.numel():
            a = cpu_table.segment_addresses(tensors, idx)
            cpu_table.addr_update(dtype, a, "add", val.to(dtype))
            addrs.append(a)
    if postscale != 1.0 and addrs:
        a = addrs[0] if len(addrs) == 1 else torch.cat(addrs)
        cpu_table.addr_update(dtype, a, "set", cpu_table.addr_update(dtype, a, "gather_scaled", scale=postscale))
