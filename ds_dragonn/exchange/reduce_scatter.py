"""Sparse reduce-scatter to fixed owners: the exchange of ZeRO stage 1/2's gradient partitions.

ZeRO partitions every flattened gradient bucket between the data-parallel ranks (DeepSpeed 0.19.8
``runtime/zero/stage_1_and_2.py``, ``average_tensor``: ``rank_and_offsets``). :class:`ReduceScatterExchange` is
phase 1 of the partitioned exchange (:func:`~ds_dragonn.exchange.partitioned.sparse_reduce_scatter`) with those
ranges as owners (:class:`RangeOwnership`); no second residual. See docs/design.md, 'The exchange schemes'.
"""
from __future__ import annotations

from typing import Hashable, List, Optional, Sequence, Tuple

import torch

from ..compress.base import Selection
from .base import Exchange, Gathered
from .ownership import Ownership
from .partitioned import max_scatter_bytes, sparse_reduce_scatter
from .wire import dense_reduce_scatter_bytes


class RangeOwnership(Ownership):
    """Owners of index ranges of a bucket, in any order and any number per rank (ZeRO's partition slices).

    The slot of an index is the index itself: an owner decodes straight into bucket coordinates.

    Args:
        numel: bucket length n.
        ranges: ``(start, length, owner)`` triples that together cover [0, n) exactly once.
        world_size: number of ranks (owners are in [0, world_size)).
    Raises:
        ValueError: the ranges leave a gap, overlap, run past n, or name an owner outside the world.
    """

    def __init__(self, numel: int, ranges: Sequence[Tuple[int, int, int]], world_size: int):
        ranges = sorted((int(s), int(n), int(o)) for s, n, o in ranges if int(n) > 0)
        pos = 0
        for start, length, owner in ranges:
            if start != pos or not 0 <= owner < world_size:
                raise ValueError(f"ranges do not partition [0, {numel}) between {world_size} ranks: "
                                 f"({start}, {length}, owner {owner}) where position {pos} was expected")
            pos += length
        if pos != numel:
            raise ValueError(f"ranges cover [0, {pos}) of a bucket of {numel} elements")
        self.numel, self.world_size = int(numel), int(world_size)
        self.ranges: List[Tuple[int, int, int]] = ranges
        self._starts = torch.tensor([s for s, _, _ in ranges], dtype=torch.int64)
        self._owners = torch.tensor([o for _, _, o in ranges], dtype=torch.int64)

    def size(self, rank: int) -> int:
        return sum(n for _, n, o in self.ranges if o == rank)

    def owned(self, rank: int) -> List[Tuple[int, int]]:
        """``(start, length)`` of every range ``rank`` owns."""
        return [(s, n) for s, n, o in self.ranges if o == rank]

    def owner_and_slot(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        pos = indices.long()
        starts, owners = self._starts.to(pos.device), self._owners.to(pos.device)
        j = torch.searchsorted(starts, pos, right=True) - 1
        return owners[j], pos

    def to_index(self, rank: int, slots: torch.Tensor) -> torch.Tensor:
        return slots.long()


class ReduceScatterExchange(Exchange):
    """Sparse reduce-scatter behind the :class:`Exchange` interface: the returned lists hold only the pairs
    addressed to this rank (one list per source rank), in bucket coordinates.

    Each reduction passes its ``ownership`` (a :class:`RangeOwnership` of that bucket): ZeRO's partition
    ranges differ from bucket to bucket.
    """

    name = "reduce_scatter"

    def exchange(self, key: Hashable, selection: Selection, numel: int, wire_dtype: torch.dtype,
                 seed: int, ownership: Optional[Ownership] = None) -> Gathered:
        """See :meth:`Exchange.exchange`. Raises ValueError when ``ownership`` is missing or is not of a
        bucket of ``numel`` elements."""
        if ownership is None or ownership.numel != numel:
            raise ValueError(f"[rank {self.backend.rank}] no owner ranges given for a bucket of {numel} elements")
        s = sparse_reduce_scatter(selection, numel, wire_dtype, ownership, self.backend, self.values)
        return Gathered(s.slots, s.values, [v.numel() for v in s.values], s.bytes_sent, s.bytes_received,
                        s.owner_pairs, sent=s.sent, finite=s.finite)

    def max_bytes(self, numel: int, pairs: int, wire_dtype: torch.dtype, world_size: int) -> int:
        return max_scatter_bytes(numel, pairs, wire_dtype, world_size, self.values)

    def dense_bytes(self, numel: int, itemsize: int, world_size: int) -> int:
        return dense_reduce_scatter_bytes(numel, itemsize, world_size)


__all__ = ["RangeOwnership", "ReduceScatterExchange", "dense_reduce_scatter_bytes"]
