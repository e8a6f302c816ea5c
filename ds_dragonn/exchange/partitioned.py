"""Partitioned exchange: a sparse reduce-scatter to balanced owners, a second residual, an allgather.

The two-phase scheme of DeepSpeed's former compressed backends (``runtime/comm/nccl.py``
``compressed_allreduce(buffer, worker_error, server_error)``, last shipped in 0.19.7) and of Ok-Topk (PPoPP'22),
with owners balanced by a shared index permutation as in Zen (OSDI'25). Phases: :func:`sparse_reduce_scatter`,
owner reduce + re-sparsify into the server residual, allgather of the owners' results (pairs or bitmap + values).
See docs/design.md, 'The exchange schemes' and 'Quantized values'.

A failed collective after phase 1 leaves the server residual holding what it received while the senders keep it
too; a failed collective ends the run, so this state is never used.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch

from .. import sparse_ops
from ..comm.base import CommBackend
from ..compress.base import Compressor, Selection, index_dtype, max_pairs, target_k
from ..feedback import ErrorFeedback
from ..undo import SavedValues, StepUndo, for_steps
from .allgather import HEADER_INTS, exchange_header, gather_pairs, header_row
from .base import Exchange, Gathered, check_agreement
from .quantize import PLAIN, ValueCodec, unpermute
from .wire import (ALIGN, align, chunk_counts_bytes, counts_header_bytes, dtype_code, index_block_bytes,
                   pair_block_bytes, read_indices, to_wire, write_indices)
from .ownership import HashedOwnership, Ownership

_BIT_WEIGHTS = [1 << b for b in range(8)]


class Scattered(NamedTuple):
    """What this rank (an owner) received in a sparse reduce-scatter.

    Attributes:
        slots: per source rank r, (c_r,) int32/int64 distinct slots in this rank's part.
        values: per source rank r, (c_r,) values in the wire dtype.
        matrix: ``matrix[src][dst]`` pairs ``src`` sent to ``dst`` (the same on every rank).
        bytes_sent, bytes_received: bytes this rank put on / took off the wire (header allgather by the ring
            model, plus the all-to-all blocks addressed to / from other ranks).
        sent: (c,) wire dtype: this rank's selection as its owners decode it (dequantized where the values
            are quantized), in the selection's order.
        finite: every value this rank sent was finite (read with the counts header).
    """
    slots: List[torch.Tensor]
    values: List[torch.Tensor]
    matrix: List[List[int]]
    bytes_sent: int
    bytes_received: int
    sent: Optional[torch.Tensor] = None
    finite: bool = False

    @property
    def owner_pairs(self) -> List[int]:
        """Pairs each owner received (self included)."""
        return [sum(row[d] for row in self.matrix) for d in range(len(self.matrix))]


def sparse_reduce_scatter(selection: Selection, numel: int, wire_dtype: torch.dtype, ownership: Ownership,
                          backend: CommBackend, codec: ValueCodec = PLAIN) -> Scattered:
    """Send each selected pair to the rank that owns its index (phase 1 of the partitioned exchange).

    Also ZeRO-1/2's primitive: with a :class:`~ds_dragonn.exchange.reduce_scatter.RangeOwnership` of the
    gradient partitions, each rank receives exactly the pairs of the partition it owns.

    Args:
        selection: this rank's pairs; indices distinct, in [0, numel); values already in ``wire_dtype``.
        numel: the bucket's length (checked to agree across ranks).
        wire_dtype: dtype of values on the wire.
        ownership: the index → (owner, slot) map; ``ownership.world_size`` must be the backend's.
        backend: the transport.
        codec: how the values travel (``exchange/quantize.py``): each destination's block is quantized on
            its own, in its travel order.
    Returns:
        :class:`Scattered`: the pairs addressed to this rank, per source rank, in slot coordinates.
    Raises:
        BufferMismatchError: on every rank, when ranks disagree on ``numel`` or ``wire_dtype``.
        ValueError: the ownership map is for another world size or length.
        CommError: a collective failed.
    """
    world, rank, device = backend.world_size, backend.rank, selection.values.device
    if ownership.world_size != world or ownership.numel != numel:
        raise ValueError(f"[rank {rank}] ownership map of {ownership.numel} elements over {ownership.world_size} "
                         f"ranks used for a bucket of {numel} over {world}")
    owner, slot = ownership.owner_and_slot(selection.indices)
        # group the pairs by owner; torch sorts 1-byte keys by radix (faster than int64)
    owner, order = torch.sort(owner.to(torch.uint8 if world <= 256 else torch.int32), stable=True)
    # the counts stay on the device and travel in the header: its rows are this scatter's one read-back
    row = header_row([0] * world + [numel, dtype_code(wire_dtype, codec.code)], selection.values, device)
    if owner.numel():
        row[:world].copy_(torch.bincount(owner.long(), minlength=world))
    header = backend.all_gather_ints(row, device)
    check_agreement([h[world] for h in header], [h[world + 1] for h in header], rank)
    matrix = [h[:world] for h in header]
    counts, finite = matrix[rank], bool(header[rank][world + 2])

    sdt = index_dtype(numel)  # slots < numel; a block's slots travel packed where smaller (wire.write_indices)
    send_sizes = [pair_block_bytes(c, numel, sdt, wire_dtype, codec) for c in counts]
    recv_counts = [matrix[src][rank] for src in range(world)]
    recv_sizes = [pair_block_bytes(c, numel, sdt, wire_dtype, codec) for c in recv_counts]
    payload = torch.zeros(sum(send_sizes), dtype=torch.uint8, device=device)
    slot, values = slot[order], selection.values.to(wire_dtype)[order]
    off = first = 0
    decoded = []  # per destination, its block's values as the owner decodes them (grouped order)
    for dst, c in enumerate(counts):
        if c:
            ib = index_block_bytes(c, numel, sdt)
            packed = write_indices(payload[off:off + ib], slot[first:first + c], c, numel, sdt)
            block = values[first:first + c]
            travel = codec.write(payload[off + ib:off + send_sizes[dst]], block if packed is None else block[packed], c)
            decoded.append(unpermute(travel, packed))
        off, first = off + send_sizes[dst], first + c
    recv = backend.all_to_all_bytes(payload, send_sizes, recv_sizes)

    slots, vals, off = [], [], 0
    for src, c in enumerate(recv_counts):
        ib = index_block_bytes(c, numel, sdt)
        slots.append(read_indices(recv[off:off + ib], c, c, numel, sdt))
        vals.append(codec.read(recv[off + ib:off + recv_sizes[src]], c, c, wire_dtype))
        off += recv_sizes[src]
    header_bytes = counts_header_bytes(world)
    sent = header_bytes + sum(s for d, s in enumerate(send_sizes) if d != rank)
    received = header_bytes + sum(s for d, s in enumerate(recv_sizes) if d != rank)
    return Scattered(slots, vals, matrix, sent, received, codec.as_sent(decoded, order), finite)


def max_scatter_bytes(numel: int, pairs: int, wire_dtype: torch.dtype, world_size: int,
                      codec: ValueCodec = PLAIN) -> int:
    """Most bytes :func:`sparse_reduce_scatter` sends per rank for at most ``pairs`` pairs: the counts header
    plus every pair addressed to another rank (padding of each block included; with quantized values, one
    more scale per destination for a group cut by a block's end)."""
    if world_size <= 1:
        return 0
    padding = (2 * ALIGN + codec.split_bytes) * (world_size - 1)  # each destination's block is aligned
    values = codec.block_bytes(pairs, wire_dtype)
    plain = align(pairs * index_dtype(numel).itemsize) + values
    # a block's positions are packed where smaller: at most its chunk counts + 2 bytes a position
    packed = (world_size - 1) * chunk_counts_bytes(numel) + align(2 * pairs) + values
    return counts_header_bytes(world_size) + min(plain, packed) + padding


def owner_seed(seed: int, owner: int) -> int:
    """The seed of ``owner``'s re-sparsification at the step whose seed is ``seed`` (not the workers')."""
    return (seed * 0x9E3779B1 + owner + 1) & 0xFFFF_FFFF


class PartitionedExchange(Exchange):
    """``"exchange": "partitioned"``: :func:`sparse_reduce_scatter` → owner reduce with a server residual →
    allgather of the owners' selections (module docstring).

    Args:
        backend: the transport.
        compressor: the owners' re-sparsification (the workers' compressor: same density, same kernel).
        error_feedback: keep the server residual (False: what an owner does not send is dropped).
    """

    name = "partitioned"

    def __init__(self, backend: CommBackend, compressor: Compressor, error_feedback: bool = True,
                 transactional: bool = False, values: ValueCodec = PLAIN):
        super().__init__(backend, values)
        self.compressor = compressor
        # transactional: the old values of every server-residual entry a step changes, so a skipped step is
        # undone exactly (sparse, except a dense flush, which saves the whole part)
        self.server = ErrorFeedback(error_feedback, undo=for_steps(transactional, StepUndo, SavedValues))
        self._ownership: Dict[int, Ownership] = {}
        self._numel: Dict[Hashable, int] = {}  # bucket length of each server residual's key

    def ownership(self, numel: int) -> Ownership:
        """The (cached) owner map of a bucket of ``numel`` elements over this group."""
        own = self._ownership.get(numel)
        if own is None:
            own = self._ownership[numel] = HashedOwnership(numel, self.backend.world_size)
        return own

    def exchange(self, key: Hashable, selection: Selection, numel: int, wire_dtype: torch.dtype,
                 seed: int, ownership=None) -> Gathered:
        backend, rank, device = self.backend, self.backend.rank, selection.values.device
        own = self.ownership(numel)
        scattered = sparse_reduce_scatter(selection, numel, wire_dtype, own, backend, self.values)
        self._numel[key] = numel

        # owner: server residual += every rank's pairs (rank order: deterministic), then re-sparsify
        part = self.server.buffer(key, own.size(rank), wire_dtype, device)
        for slots, vals in zip(scattered.slots, scattered.values):
            self.server.undo.save(key, part, slots)
            sparse_ops.add_(part, slots, vals)
        sel = self.compressor.compress(part, owner_seed(seed, rank))
        # fp16: the owner's float32 sum of P ranks can exceed 65504 where the average does not; send the
        # average (the decode's postscale is divided by the same factor) and keep its rounding as residual
        scale = 1.0 / backend.world_size if wire_dtype == torch.float16 else 1.0
        wire = to_wire(sel.values * scale if scale != 1.0 else sel.values, wire_dtype)

        # quantized values: the owner re-quantizes its selection, and its rounding stays in its server residual
        counts, server_finite = exchange_header(sel.count, numel, wire_dtype, backend, device, values=self.values,
                                                sent=sel.values)
        idx, val, moved, wire = self._gather(own, sel.indices, wire, counts, numel, wire_dtype)
        self.server.commit(key, sel.indices, sel.values, wire if scale == 1.0 else wire.float() / scale)
        if self.server.enabled and not (server_finite and getattr(self.compressor, "sends_non_finite", False)):
            self.server.clear_non_finite(key)
        header = (backend.world_size - 1) * HEADER_INTS * 8
        return Gathered(idx, val, counts, scattered.bytes_sent + header + moved,
                        scattered.bytes_received + header + moved, scattered.owner_pairs, scale, scattered.sent,
                        scattered.finite)

    def max_bytes(self, numel: int, pairs: int, wire_dtype: torch.dtype, world_size: int) -> int:
        """Phase 1 (:func:`max_scatter_bytes`) plus the owners' allgather of at most ``max_pairs`` of
        their ``ceil(n/P)`` elements, as pairs or bitmap + values, whichever is smaller."""
        if world_size <= 1:
            return 0
        part = -(-numel // world_size)
        owner = align(max_pairs(target_k(part, self.compressor.density)))
        gathered = (min(index_block_bytes(owner, numel, index_dtype(numel)), align(-(-part // 8)))
                    + self.values.block_bytes(owner, wire_dtype))
        return (max_scatter_bytes(numel, pairs, wire_dtype, world_size, self.values)
                + (world_size - 1) * (HEADER_INTS * 8 + gathered))

    def _gather(self, own: Ownership, slots: torch.Tensor, wire: torch.Tensor, counts: List[int], numel: int,
                wire_dtype: torch.dtype) -> Tuple[List[torch.Tensor], List[torch.Tensor], int, torch.Tensor]:
        """Allgather the owners' (slot, value) selections as pairs or as bitmap + values, whichever is smaller.
        Returns (global indices, values, bytes sent, bytes received, this owner's values as decoded, in the order
        of ``slots``)."""
        world, rank, device = self.backend.world_size, self.backend.rank, wire.device
        idt, codec = index_dtype(numel), self.values
        cap = align(max(counts, default=0))
        bitmap_bytes = align(-(-max(own.size(r) for r in range(world)) // 8))
        if max(counts, default=0) == 0 or index_block_bytes(cap, numel, idt) <= bitmap_bytes:
            got = gather_pairs(own.to_index(rank, slots).to(idt), wire, counts, numel, idt, wire_dtype,
                               self.backend, codec=codec)
            return got.indices, got.values, (world - 1) * got.payload_bytes, got.sent
        # bitmap over the owner's part (bit s = slot s sent), then the values in slot order
        slots, order = torch.sort(slots.long())
        payload = torch.zeros(bitmap_bytes + codec.block_bytes(cap, wire_dtype), dtype=torch.uint8, device=device)
        bits = torch.zeros(bitmap_bytes * 8, dtype=torch.uint8, device=device)
        bits[slots] = 1
        weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=device)
        payload[:bitmap_bytes] = (bits.view(-1, 8) * weights).sum(1, dtype=torch.uint8)
        sent = unpermute(codec.write(payload[bitmap_bytes:], wire[order], cap), order)
        rows = self.backend.all_gather_bytes(payload)
        idx, val = [], []
        for r in range(world):
            flags = (rows[r, :bitmap_bytes].unsqueeze(1) & weights).ne(0).flatten()[:own.size(r)]
            got = flags.nonzero().flatten()
            if got.numel() != counts[r]:
                raise ValueError(f"[rank {rank}] owner {r}'s bitmap marks {got.numel()} slots for {counts[r]} values: "
                                 f"a corrupt exchange, or ranks reducing different buckets")
            idx.append(own.to_index(r, got).to(idt))
            val.append(codec.read(rows[r, bitmap_bytes:], counts[r], cap, wire_dtype))
        return idx, val, (world - 1) * payload.numel(), sent

    def flush_into(self, key: Hashable, buf: torch.Tensor) -> None:
        """Add this rank's server residual of ``key`` into the bucket-sized ``buf`` at the indices it owns,
        and zero it (a compressed→dense switch sends it with the dense allreduce)."""
        part = self.server.residuals.get(key)
        if part is None or part.numel() == 0:
            return
        own = self.ownership(buf.numel())
        sparse_ops.add_(buf, own.to_index(self.backend.rank, torch.arange(part.numel(), device=part.device)), part)
        self.server.undo.save(key, part, None)
        part.zero_()

    def end_step(self, applied: bool) -> None:
        """A skipped step's changes to the server residuals are undone, newest first (exact)."""
        self.server.end_step(applied)

    def rescale_(self, factor: float) -> None:
        self.server.rescale_(factor)

    def state_dict(self) -> dict:
        """This rank's server residuals with what they belong to: the world size, this rank (the owner)
        and each bucket's length (which fixes the owner map)."""
        return {"server": self.server.state_dict(), "world_size": self.backend.world_size,
                "rank": self.backend.rank, "numel": dict(self._numel)}

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        """Restore server residuals saved by :meth:`state_dict`.

        Residuals saved by another owner (another world size or rank) are dropped with a warning naming what
        differs; every rank of a resized job drops its own, so all ranks stay consistent.
        Raises:
            ValueError: a residual's length does not match its bucket's owner map here (a corrupt or
                foreign state), naming the bucket.
        """
        self.server.undo.clear()  # a step left open before the load must not undo into the loaded state
        saved_world, saved_rank = state.get("world_size"), state.get("rank")
        world, rank = self.backend.world_size, self.backend.rank
        if (saved_world, saved_rank) != (world, rank):
            from deepspeed.utils import logger
            if (state.get("server") or {}).get("residuals"):  # (an allgather exchange's state holds none)
                logger.warning(f"[rank {rank}] DRAGONN: server residuals saved by rank {saved_rank} of {saved_world} "
                               f"dropped (this is rank {rank} of {world}): their owner map no longer applies")
            self.server.reset()
            self._numel = {}
            return
        numels = dict(state.get("numel", {}))
        for key, buf in state["server"]["residuals"].items():
            if key not in numels or buf.dim() != 1 or buf.numel() != self.ownership(numels[key]).size(rank):
                raise ValueError(f"[rank {rank}] server residual for bucket {key!r} has shape {tuple(buf.shape)}, "
                                 f"but the bucket's owner map gives rank {rank} "
                                 f"{self.ownership(numels[key]).size(rank) if key in numels else '?'} indices "
                                 f"(bucket length {numels.get(key, 'not saved')})")
        self.server.load_state_dict(state["server"], device)
        self._numel = numels

    def reset(self) -> None:
        self.server.reset()
        self._numel = {}


__all__ = ["PartitionedExchange", "Scattered", "owner_seed", "sparse_reduce_scatter"]
