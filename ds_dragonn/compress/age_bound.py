"""The age bound (``advanced.max_age``): every entry of a bucket is sent at least once every ``max_age``
compressed steps.

The bucket is cut into ``max_age`` contiguous blocks of ``ceil(n / max_age)`` entries, and the compressed step of
index ``c`` also sends block ``c mod max_age`` whole, as the selection's ``whole`` tail
(:class:`~ds_dragonn.compress.base.Selection`). The clock counts compressed steps, not optimizer steps
(``HookBase.age_clock``). See docs/design.md, 'The age bound'.
"""
from __future__ import annotations

import torch

from .base import Selection


def age_block(numel: int, max_age: int, index: int) -> tuple:
    """The block ``[lo, hi)`` that the compressed step of index ``index`` sends whole: block ``index mod max_age`` of
    ``ceil(numel / max_age)`` entries (the last blocks may be short or empty). ``(0, 0)`` when ``max_age`` is 0 (no
    bound) or the buffer is empty.

    Raises:
        ValueError: ``numel``, ``max_age`` or ``index`` negative.
    """
    if numel < 0 or max_age < 0 or index < 0:
        raise ValueError(f"numel, max_age and index must be >= 0, got numel={numel}, max_age={max_age}, index={index}")
    if max_age == 0 or numel == 0:
        return 0, 0
    size = -(-numel // max_age)
    lo = min(numel, (index % max_age) * size)
    return lo, min(numel, lo + size)


def block_capacity(numel: int, max_age: int) -> int:
    """The most entries one step's block holds: ``ceil(numel / max_age)`` (0 without a bound)."""
    return -(-numel // max_age) if max_age > 0 and numel > 0 else 0


def with_age_block(sel: Selection, flat: torch.Tensor, max_age: int, index: int) -> Selection:
    """``sel`` plus every entry of this step's block (:func:`age_block`), which becomes its ``whole`` tail.

    Args:
        sel: the compressor's selection from ``flat`` (with no ``whole`` tail of its own).
        flat: the (n,) buffer ``sel`` was selected from (the compensated residual).
        max_age: the bound in steps (0: ``sel`` is returned as it is).
        index: the compressed step's index (the age bound's clock, module docstring), equal on every rank.
    Returns:
        A :class:`Selection` whose head is ``sel``'s pairs outside the block (their order kept) and whose tail is
        the block's ``hi − lo`` entries in position order; ``capacity`` grows by :func:`block_capacity` (the same on
        every rank; not at all where the block is empty: then ``sel`` itself is returned).
    Raises:
        ValueError: ``sel`` already has a whole tail.
    """
    lo, hi = age_block(flat.numel(), max_age, index)
    if hi <= lo:
        return sel
    if sel.whole:
        raise ValueError("the age bound's block cannot join a selection that already sends whole tensors")
    idx = sel.indices
    outside = (idx < lo) | (idx >= hi)
    tail = torch.arange(lo, hi, dtype=idx.dtype, device=idx.device)
    return Selection(torch.cat([idx[outside], tail]), torch.cat([sel.values[outside], flat[lo:hi].to(sel.values.dtype)]),
                     sel.threshold, sel.k, sel.capacity + block_capacity(flat.numel(), max_age), hi - lo)


__all__ = ["age_block", "block_capacity", "with_age_block"]
