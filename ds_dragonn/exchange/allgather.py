"""Allgather exchange (DRAGONN paper, Sec. 4): every rank gathers every rank's (index, value) pairs.

Wire format per rank, one ``all_gather`` of bytes after one small header ``all_gather``:

* header: ``[count, numel, dtype code]`` (int64 × 3). It sizes the payload and lets every rank check
  that all ranks reduce the same buffer — a mismatch raises the same error on every rank instead of
  hanging in a collective of unequal size.
* payload: ``C`` indices then ``C`` values as raw bytes, ``C`` = the largest count over ranks rounded
  up to a multiple of 8 (keeps every block aligned for a zero-copy view). Shorter lists are padded.

Bytes reported are those a ring allgather makes each rank send: ``(P - 1) × (header + payload)``.
"""
from __future__ import annotations

from typing import List, NamedTuple

import torch

from ..comm.base import CommBackend
from ..compress.base import Selection, index_dtype

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_HEADER_BYTES = 3 * 8
_ALIGN = 8


class Gathered(NamedTuple):
    """Every rank's pairs after the exchange.

    Attributes:
        indices: per rank r, (counts[r],) int32/int64 positions.
        values: per rank r, (counts[r],) values in the wire dtype.
        counts: pairs sent by each rank.
        bytes_sent: bytes this rank put on the wire (ring-allgather model, header included).
    """
    indices: List[torch.Tensor]
    values: List[torch.Tensor]
    counts: List[int]
    bytes_sent: int


class BufferMismatchError(ValueError):
    """Ranks tried to reduce buffers of different sizes or dtypes."""


def allgather_exchange(selection: Selection, numel: int, wire_dtype: torch.dtype,
                       backend: CommBackend) -> Gathered:
    """Exchange one buffer's selection with every rank.

    Args:
        selection: this rank's pairs; values are cast to ``wire_dtype``.
        numel: length of the buffer the selection came from (must agree across ranks).
        wire_dtype: dtype of values on the wire (the buffer's communication dtype).
        backend: the transport.
    Raises:
        BufferMismatchError: on every rank, when ranks disagree on ``numel`` or ``wire_dtype``.
    """
    device = selection.values.device
    if wire_dtype not in _DTYPE_CODES:
        raise TypeError(f"unsupported gradient dtype {wire_dtype}; supported: {list(_DTYPE_CODES)}")
    world = backend.world_size
    header = backend.all_gather_ints([selection.count, numel, _DTYPE_CODES[wire_dtype]], device)
    _check_agreement(header, backend.rank)
    counts = [h[0] for h in header]
    idx_dtype = index_dtype(numel)
    if max(counts) == 0:
        empty_i = torch.empty(0, dtype=idx_dtype, device=device)
        empty_v = torch.empty(0, dtype=wire_dtype, device=device)
        return Gathered([empty_i] * world, [empty_v] * world, counts, (world - 1) * _HEADER_BYTES)

    cap = -(-max(counts) // _ALIGN) * _ALIGN
    ib = torch.empty((), dtype=idx_dtype).element_size()
    vb = torch.empty((), dtype=wire_dtype).element_size()
    payload = torch.zeros(cap * (ib + vb), dtype=torch.uint8, device=device)
    c = selection.count
    payload[:c * ib].view(idx_dtype).copy_(selection.indices.to(idx_dtype))
    payload[cap * ib:cap * ib + c * vb].view(wire_dtype).copy_(selection.values.to(wire_dtype))

    rows = backend.all_gather_bytes(payload)
    indices = [rows[r, :counts[r] * ib].view(idx_dtype) for r in range(world)]
    values = [rows[r, cap * ib:cap * ib + counts[r] * vb].view(wire_dtype) for r in range(world)]
    bytes_sent = (world - 1) * (_HEADER_BYTES + payload.numel())
    return Gathered(indices, values, counts, bytes_sent)


def check_buffer_agreement(numel: int, dtype: torch.dtype, backend: CommBackend, device: torch.device) -> None:
    """One small allgather of ``(numel, dtype)``: every rank raises :class:`BufferMismatchError` when they differ.

    The pipeline runs it the first time it sees a bucket, before it touches the residual; the header of
    every exchange repeats the check.
    """
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"unsupported gradient dtype {dtype}; supported: {list(_DTYPE_CODES)}")
    _check_agreement(backend.all_gather_ints([0, numel, _DTYPE_CODES[dtype]], device), backend.rank)


def _check_agreement(header: List[List[int]], rank: int) -> None:
    sizes = {h[1] for h in header}
    dtypes = {h[2] for h in header}
    if len(sizes) > 1 or len(dtypes) > 1:
        names = {v: str(k).replace("torch.", "") for k, v in _DTYPE_CODES.items()}
        per_rank = ", ".join(f"rank {r}: {h[1]} x {names.get(h[2], h[2])}" for r, h in enumerate(header))
        raise BufferMismatchError(f"[rank {rank}] ranks disagree on the gradient buffer to reduce "
                                  f"({per_rank}); every rank must reduce the same model's gradients")
