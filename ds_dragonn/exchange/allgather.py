"""Allgather exchange (DRAGONN paper, Sec. 4): every rank gathers every rank's (index, value) pairs.

Per rank: one small header ``all_gather`` (``[count, numel, dtype code, whole, finite]``: sizes the payload and
checks that all ranks reduce the same buffer), then one ``all_gather`` of ``[positions][values]`` rows padded to
the largest count, positions packed where smaller (``wire.write_indices``), values in the wire dtype or int8/int4
codes (``exchange/quantize.py``). The last ``whole`` values of a list need no indices. Each rank receives P·k
pairs; bytes reported are a ring allgather's ``(P - 1) × (header + payload)``. See docs/design.md, 'The exchange
schemes'.
"""
from __future__ import annotations

from typing import Hashable, List, NamedTuple, Optional, Tuple

import torch

from ..comm.base import CommBackend
from ..compress.base import Selection, index_dtype
from .base import Exchange, BufferMismatchError, Gathered, check_agreement
from .quantize import PLAIN, ValueCodec, unpermute
from .wire import align, dtype_code, index_block_bytes, read_indices, write_indices

HEADER_INTS = 5  # [count, numel, dtype code, whole, all sent values finite]


class GatheredPairs(NamedTuple):
    """What :func:`gather_pairs` returns.

    Attributes:
        indices: per rank, (counts[r],) ``idx_dtype`` positions.
        values: per rank, (counts[r],) ``wire_dtype`` values as decoded (dequantized where quantized).
        payload_bytes: bytes of one rank's row (the ring allgather sends ``(P − 1)`` of them).
        sent: (c,) ``wire_dtype``: this rank's values as every rank decodes them, in the order given.
    """
    indices: List[torch.Tensor]
    values: List[torch.Tensor]
    payload_bytes: int
    sent: Optional[torch.Tensor]


def header_row(ints: List[int], values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``ints + [all of values finite]`` as a (len(ints)+1,) int64 tensor on ``device``; the flag is computed
    on the device and travels in the header's allgather, so it costs no read-back of its own."""
    row = torch.tensor(list(ints) + [1], dtype=torch.int64, device=device)
    if values.numel():
        row[-1:].copy_(torch.isfinite(values).all().reshape(1))
    return row


def exchange_header(count: int, numel: int, wire_dtype: torch.dtype, backend: CommBackend,
                    device: torch.device, whole: int = 0, values: ValueCodec = PLAIN,
                    sent: Optional[torch.Tensor] = None) -> Tuple[List[int], bool]:
    """Allgather ``[count, numel, dtype, whole, finite]``; check every rank reduces the same buffer in the same
    value format (and sends the same whole tensors); return the counts and whether this rank's ``sent``
    values (None: none) are all finite (the error feedback then skips its non-finite pass)."""
    row = header_row([count, numel, dtype_code(wire_dtype, values.code), whole],
                     sent if sent is not None else torch.empty(0), device)
    header = backend.all_gather_ints(row, device)
    check_agreement([h[1] for h in header], [h[2] for h in header], backend.rank)
    if len({h[3] for h in header}) > 1:
        raise BufferMismatchError(f"rank {backend.rank}: ranks send different whole tensors in one bucket "
                                  f"({[h[3] for h in header]} elements per rank): their per-tensor segments differ")
    return [h[0] for h in header], bool(header[backend.rank][4])


def gather_pairs(indices: torch.Tensor, values: torch.Tensor, counts: List[int], numel: int,
                 idx_dtype: torch.dtype, wire_dtype: torch.dtype, backend: CommBackend, whole: int = 0,
                 codec: ValueCodec = PLAIN) -> GatheredPairs:
    """Allgather every rank's ``counts[r]`` pairs (counts from :func:`exchange_header`); the last ``whole``
    pairs of every list (the same positions on every rank) travel without their indices.

    Args:
        numel: the buffer's length (fixes the chunk grid of the packed positions).
        codec: how the values travel (``exchange/quantize.py``; every rank the same).
    Returns:
        :class:`GatheredPairs`.
    """
    world, device = backend.world_size, values.device
    wire = values.to(wire_dtype)
    if max(counts, default=0) == 0:
        return GatheredPairs([torch.empty(0, dtype=idx_dtype, device=device)] * world,
                             [torch.empty(0, dtype=wire_dtype, device=device)] * world, 0, wire)
    vcap = align(max(counts))
    icap = align(max(counts) - whole)
    ib = index_block_bytes(icap, numel, idx_dtype)
    payload = torch.zeros(ib + codec.block_bytes(vcap, wire_dtype), dtype=torch.uint8, device=device)
    head = indices.numel() - whole
    order = write_indices(payload[:ib], indices[:head], icap, numel, idx_dtype)
    if order is not None:  # packed positions travel sorted: their values follow them
        wire = torch.cat([wire[:head][order], wire[head:]])
    sent = codec.write(payload[ib:], wire, vcap)
    if order is not None:
        sent = torch.cat([unpermute(sent[:head], order), sent[head:]])
    rows = backend.all_gather_bytes(payload)
    tail = indices[head:].to(idx_dtype)
    idx = [read_indices(rows[r, :ib], counts[r] - whole, icap, numel, idx_dtype) for r in range(world)]
    if whole:
        idx = [torch.cat([i, tail]) for i in idx]
    val = [codec.read(rows[r, ib:], counts[r], vcap, wire_dtype) for r in range(world)]
    return GatheredPairs(idx, val, payload.numel(), sent)


def allgather_exchange(selection: Selection, numel: int, wire_dtype: torch.dtype,
                       backend: CommBackend, codec: ValueCodec = PLAIN) -> Gathered:
    """Exchange one buffer's selection with every rank.

    Args:
        selection: this rank's pairs; values are cast to ``wire_dtype``.
        numel: length of the buffer the selection came from (must agree across ranks).
        wire_dtype: dtype of values on the wire (the buffer's communication dtype).
        backend: the transport.
        codec: how the values travel (``exchange/quantize.py``).
    Raises:
        BufferMismatchError: on every rank, when ranks disagree on ``numel``, ``wire_dtype`` or the value format.
    """
    counts, finite = exchange_header(selection.count, numel, wire_dtype, backend, selection.values.device,
                                     selection.whole, codec, selection.values)
    got = gather_pairs(selection.indices, selection.values, counts, numel, index_dtype(numel), wire_dtype, backend,
                       selection.whole, codec)
    moved = (backend.world_size - 1) * (HEADER_INTS * 8 + got.payload_bytes)
    return Gathered(got.indices, got.values, counts, moved, moved, sent=codec.as_sent([got.sent]), finite=finite)


class AllgatherExchange(Exchange):
    """``"exchange": "allgather"``: :func:`allgather_exchange` behind the :class:`Exchange` interface."""

    name = "allgather"

    def exchange(self, key: Hashable, selection: Selection, numel: int, wire_dtype: torch.dtype,
                 seed: int, ownership=None) -> Gathered:
        return allgather_exchange(selection, numel, wire_dtype, self.backend, self.values)

    def max_bytes(self, numel: int, pairs: int, wire_dtype: torch.dtype, world_size: int) -> int:
        """``(P − 1) × (header + padded pairs)``: every rank's list goes to every other rank."""
        cap = align(pairs)
        return (world_size - 1) * (HEADER_INTS * 8 + index_block_bytes(cap, numel, index_dtype(numel))
                                   + self.values.block_bytes(cap, wire_dtype))
