"""The age bound (``advanced.max_age``): every entry of a bucket is sent at least once every ``max_age`` steps.

At density 0.001 an entry whose accumulated residual stays below the threshold waits ~1/density = 1000 steps
for its turn, and then arrives as one burst (issue 38 item 4; DGC's answer at that density is a density warm-up
and momentum correction, not a bound). The bound here costs no memory and no extra pass: the bucket is cut into
``max_age`` contiguous blocks of ``ceil(n / max_age)`` entries, and step ``s`` also sends block
``(s − ⌊s / max_age⌋) mod max_age`` whole, whatever its magnitudes: each cycle of ``max_age`` steps sends every
block once, in an order shifted by one per cycle, so that a periodic dense step (a variance refresh every 100 steps
with ``max_age`` 100) skips a different block each time instead of always the same one. Every rank sends the same block, so the block rides as the
selection's ``whole`` tail (:class:`~ds_dragonn.compress.base.Selection`): the allgather exchange sends its
values without positions (``exchange/allgather.py``); the other exchanges send it as ordinary pairs. What the
block sends leaves the residual like any selected entry (error feedback, nothing lost).

An entry waits at most ``max_age + 1`` steps between sends of its block. A step that goes dense (the warm-ups, a
variance refresh) skips its block: in the momentum mode a refresh sends the raw gradient, not the residual.
"""
from __future__ import annotations

import torch

from .base import Selection


def age_block(numel: int, max_age: int, step: int) -> tuple:
    """The block ``[lo, hi)`` that step ``step`` sends whole: block ``(step − ⌊step / max_age⌋) mod max_age`` of
    ``ceil(numel / max_age)`` entries (the last blocks may be short or empty). ``(0, 0)`` when ``max_age`` is 0 (no bound) or the buffer is
    empty.

    Raises:
        ValueError: ``max_age`` or ``step`` negative.
    """
    if max_age < 0 or step < 0:
        raise ValueError(f"max_age and step must be >= 0, got max_age={max_age}, step={step}")
    if max_age == 0 or numel == 0:
        return 0, 0
    size = -(-numel // max_age)
    lo = min(numel, ((step - step // max_age) % max_age) * size)
    return lo, min(numel, lo + size)


def block_capacity(numel: int, max_age: int) -> int:
    """The most entries one step's block holds: ``ceil(numel / max_age)`` (0 without a bound)."""
    return -(-numel // max_age) if max_age > 0 and numel > 0 else 0


def with_age_block(sel: Selection, flat: torch.Tensor, max_age: int, step: int) -> Selection:
    """``sel`` plus every entry of this step's block (:func:`age_block`), which becomes its ``whole`` tail.

    Args:
        sel: the compressor's selection from ``flat`` (with no ``whole`` tail of its own).
        flat: the (n,) buffer ``sel`` was selected from (the compensated residual).
        max_age: the bound in steps (0: ``sel`` is returned as it is).
        step: the optimizer step (local steps: the round), equal on every rank.
    Returns:
        A :class:`Selection` whose head is ``sel``'s pairs outside the block (their order kept) and whose tail is
        the block's ``hi − lo`` entries in position order; ``capacity`` grows by :func:`block_capacity`, the same
        on every step and rank.
    Raises:
        ValueError: ``sel`` already has a whole tail.
    """
    lo, hi = age_block(flat.numel(), max_age, step)
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
