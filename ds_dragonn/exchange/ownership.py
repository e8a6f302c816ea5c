"""Which rank owns (reduces) each index of a bucket, and where it keeps it: the map of a sparse reduce-scatter.

An :class:`Ownership` splits a bucket of n elements into ``world_size`` disjoint parts. Owner r keeps its
part as a compact (n_r,) buffer addressed by *slots* 0..n_r-1; the map index → (owner, slot) and its
inverse are O(1) per index and computed, never stored.

* Contiguous ranges ``[bounds[r], bounds[r+1])`` as they are (DeepSpeed's former compressed backends)
  are cheap, but a gradient whose large entries sit together loads one owner: Ok-Topk measured max/mean
  1.4–5.1 on contiguous regions. ZeRO's own partitions are :class:`~ds_dragonn.exchange.reduce_scatter.RangeOwnership`.
* :class:`HashedOwnership` (the ``partitioned`` exchange): contiguous ranges of a *permuted* index,
  ``p(i) = a·i mod n`` with ``a ≈ n/φ`` (φ the golden ratio) and ``gcd(a, n) = 1``: a bijection with an exact
  inverse, balanced sizes, and no table for the slot. A run of consecutive indices maps to a Weyl sequence
  ``{i·a/n}``, which the three-distance theorem spreads over the P ranges more evenly than random (Zen, OSDI'25,
  balances owners with a shared hash for the same reason; measured imbalance: docs/results.md, 'Many ranks').
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # 1/φ
_SPLIT = 1 << 16


def _mulmod(x: torch.Tensor, a: int, n: int) -> torch.Tensor:
    """``(a · x) mod n`` for int64 ``x`` and ``a`` in [0, n), n < 2^32, without int64 overflow."""
    if n < (1 << 31):
        return (x * a) % n
    hi, lo = divmod(a, _SPLIT)  # a·x = (hi·x mod n)·2^16 + lo·x: every product stays below 2^48
    return (((x * hi) % n) * _SPLIT + x * lo) % n


class Ownership:
    """Contiguous index ranges per rank, in a permuted index space ``p(i)`` (identity here).

    Args:
        numel: bucket length n (≥ 0).
        bounds: ``world_size + 1`` non-decreasing permuted positions, ``bounds[0] == 0``,
            ``bounds[-1] == numel``: rank r owns permuted positions ``[bounds[r], bounds[r+1])``.
    Raises:
        ValueError: the bounds do not partition [0, numel).
    """

    def __init__(self, numel: int, bounds: Sequence[int]):
        bounds = [int(b) for b in bounds]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != numel or any(
                b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
            raise ValueError(f"bounds {bounds[:8]}{'...' if len(bounds) > 8 else ''} do not partition "
                             f"[0, {numel}) into contiguous ranges")
        self.numel = int(numel)
        self.bounds: List[int] = bounds
        self.world_size = len(bounds) - 1

    def size(self, rank: int) -> int:
        """n_r: how many indices ``rank`` owns."""
        return self.bounds[rank + 1] - self.bounds[rank]

    def permute(self, indices: torch.Tensor) -> torch.Tensor:
        """p(i) as int64 (identity)."""
        return indices.long()

    def unpermute(self, positions: torch.Tensor) -> torch.Tensor:
        """i = p⁻¹(pos) as int64 (identity)."""
        return positions.long()

    def owner_and_slot(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(owner, slot), both (c,) int64, of (c,) indices in [0, numel)."""
        pos = self.permute(indices)
        starts = torch.tensor(self.bounds, dtype=torch.int64, device=pos.device)
        owner = torch.searchsorted(starts[1:], pos, right=True)
        return owner, pos - starts[owner]

    def to_index(self, rank: int, slots: torch.Tensor) -> torch.Tensor:
        """(c,) int64 bucket indices of ``rank``'s (c,) slots."""
        return self.unpermute(slots.long() + self.bounds[rank])


class HashedOwnership(Ownership):
    """Owner ranges over the permutation ``p(i) = a·i mod n`` (see the module docstring); balanced sizes.

    Depends only on ``numel`` and ``world_size``, so every rank builds the same map without talking.

    Raises:
        ValueError: ``world_size`` < 1, or ``numel`` ≥ 2^32 (split such a bucket: DeepSpeed's
            ``reduce_bucket_size`` defaults to 5·10^8).
    """

    def __init__(self, numel: int, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if numel >= 1 << 32:
            raise ValueError(f"the partitioned exchange maps buckets below 2^32 elements, got {numel}; "
                             f"lower DeepSpeed's 'reduce_bucket_size'")
        super().__init__(numel, [r * numel // world_size for r in range(world_size + 1)])
        a = max(1, round(numel * _GOLDEN))
        while math.gcd(a, max(numel, 1)) != 1:
            a += 1
        self.multiplier = a
        self.inverse = pow(a, -1, numel) if numel > 1 else 0

    def permute(self, indices: torch.Tensor) -> torch.Tensor:
        return _mulmod(indices.long(), self.multiplier, max(self.numel, 1))

    def unpermute(self, positions: torch.Tensor) -> torch.Tensor:
        return _mulmod(positions.long(), self.inverse, max(self.numel, 1))


__all__ = ["HashedOwnership", "Ownership"]
