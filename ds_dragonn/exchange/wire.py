"""What goes on the wire, and what it costs: value dtype codes, block alignment, the clamp to a 16-bit wire
dtype, bucket digests, and every byte model (dense ring collectives, sparse headers and blocks).

One home for these numbers: the exchanges, the engine's dense-or-compressed decision, the telemetry and
the benchmarks (``launch/``) all import them, so a model changes in one place. Byte models are per rank,
sent bytes, ring algorithms (NCCL's and gloo's default for large buffers).
"""
from __future__ import annotations

import hashlib
from typing import Hashable

import torch

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
ALIGN = 8  # every block of a payload starts on 8 bytes: zero-copy views of any dtype


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def to_wire(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in the wire dtype; finite values beyond its range are clamped to its largest finite value.

    A residual accumulated in float32 can exceed fp16's 65504 although no gradient does: sent as Inf it
    would poison the result (fp32 training has no loss scaler to catch it) and the residual would drop
    it. Clamped, the excess stays in the residual. Non-finite values are sent as they are.
    """
    if dtype not in (torch.float16, torch.bfloat16) or values.dtype == dtype:
        return values.to(dtype)
    big = torch.finfo(dtype).max
    return torch.where(torch.isfinite(values), values.clamp(-big, big), values).to(dtype)


def dense_allreduce_bytes(numel: int, itemsize: int, world_size: int) -> int:
    """Bytes each rank sends in a ring allreduce of ``numel`` elements: ``2(P-1)/P × numel × itemsize``."""
    return int(2 * (world_size - 1) * numel * itemsize // max(world_size, 1))

def dense_reduce_scatter_bytes(numel: int, itemsize: int, world_size: int) -> int:
    """Bytes each rank sends in a ring reduce-scatter of ``numel`` elements: ``(P-1)/P × numel × itemsize``."""
    return int((world_size - 1) * numel * itemsize // max(world_size, 1))


def counts_header_bytes(world: int) -> int:
    """Bytes each rank sends in the counts-header allgather of a sparse reduce-scatter (ring model)."""
    return (world - 1) * (world + 2) * 8


def block_bytes(count: int, idx_dtype: torch.dtype, wire_dtype: torch.dtype) -> int:
    """Bytes of one block of ``count`` (index, value) pairs: each array aligned to :data:`ALIGN`."""
    return align(count * idx_dtype.itemsize) + align(count * wire_dtype.itemsize)


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of a value dtype. Raises TypeError for dtypes the exchanges do not carry."""
    if dtype not in DTYPE_CODES:
        raise TypeError(f"unsupported gradient dtype {dtype}; supported: {list(DTYPE_CODES)}")
    return DTYPE_CODES[dtype]


#: wire codes of the exchange schemes, for the agreement check
SCHEME_CODES = {"allgather": 0, "partitioned": 1, "reduce_scatter": 2}


def bucket_code(key: Hashable) -> int:
    """A 56-bit digest of a bucket key (its position, dtype, length and parameter names), equal on every rank
    whose bucket holds the same parameters (``repr`` + blake2b: not Python's per-process ``hash``)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=7).digest(), "little")
