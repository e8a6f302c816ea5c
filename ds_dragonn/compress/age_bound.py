"""The age bound (``advanced.max_age``): every entry of a bucket is sent at least once every ``max_age``
compressed steps.

At density 0.001 an entry whose accumulated residual stays below the threshold waits ~1/density = 1000 steps
for its turn, and then arrives as one burst (DGC's answer at that density is a density warm-up
and momentum correction, not a bound). The bound here costs no memory and no extra pass: the bucket is cut into
``max_age`` contiguous blocks of ``ceil(n / max_age)`` entries, and the compressed step of index ``c`` also sends
block ``c mod max_age`` whole, whatever its magnitudes. Every rank sends the same block, so the block rides as the
selection's ``whole`` tail (:class:`~ds_dragonn.compress.base.Selection`): the allgather exchange sends its
values without positions (``exchange/allgather.py``); the other exchanges send it as ordinary pairs. What the
block sends leaves the residual like any selected entry (error feedback, nothing lost).

The clock ``c`` counts compressed steps, not optimizer steps (``DensitySchedule.compressed_index``): a variance
refresh sends the raw gradient and leaves the residual unsent, so if it used up a block, a refresh period that
aliases with the block order would skip the same block again and again (with the optimizer step as the clock and
``max_age`` equal to the refresh period, one block would never be sent). Every other dense step (the policy's)
flushes the whole residual. So an entry waits at most ``max_age`` compressed steps, plus the refreshes between
them. Local steps count rounds. A step that DeepSpeed skips on overflow (fp16, bf16 with ``check_grad_overflow``)
is rolled back with its residuals (engine/steps.py) and gives its index back: the hook's clock is the compressed
index less those steps (``HookBase.age_clock``, checkpointed with the residuals, 0 when they start empty), so
the next compressed step sends the block it did not.
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
