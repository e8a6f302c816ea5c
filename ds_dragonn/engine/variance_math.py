"""The arithmetic of the momentum mode's frozen Adam variance, one pure function per step (``engine/variance.py``
holds the optimizer hook).

``V̂`` (Adam's bias-corrected variance, recorded at the end of the dense warm-up, then moved by variance
refreshes) lives in Adam's own ``exp_avg_sq``, and the elements it is frozen for are those whose ``exp_avg`` is
kept at 0 (:func:`known_mask`): the freeze stores nothing of its own. Before each step the pre-hook applies the
frozen elements' update itself (:func:`momentum_step_`) and sets their moments so that Adam's step applies none
and leaves ``V̂`` in place (:func:`before_decay`). The other elements had no gradient before the freeze (a rare
token's embedding row, a layer or expert that first gets gradient later): they have no variance to divide by.
Dividing their momentum by the floor would move them by hundreds of learning rates per step, where Adam's own
update stays near one (docs/results.md). They keep Adam's own update, its own moments following what arrives
(bounded like Adam's), until a variance refresh gives them an estimate (:func:`refresh_`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

#: each tensor's frozen ``sqrt(V̂)`` is at least this fraction of its mean over the known elements (the former
#: ``variance_floor`` key's default; a floor of 0 gave the same LM result, docs/results.md)
VARIANCE_FLOOR = 0.01

#: the least weight the frozen variance keeps at a refresh: one step's g² is a one-sample estimate, so it gets
#: at most 10 % (a smaller floor measured worse on the LM: docs/results.md)
DEFAULT_DECAY_FLOOR = 0.9


def default_refresh_decay(beta2: float, refresh_steps: int) -> float:
    """``ρ`` of a variance refresh: ``max(β2^refresh_steps, DEFAULT_DECAY_FLOOR)``."""
    return max(beta2 ** max(refresh_steps, 1), DEFAULT_DECAY_FLOOR)


def floor_variance_(v: torch.Tensor, floor: float, where: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``v`` raised in place to ``(floor × mean sqrt(v))²`` (the mean over ``where``'s elements, all if None),
    where that is finite and > 0; returns ``v``."""
    sel = v if where is None else v[where]
    if floor > 0.0 and sel.numel():
        low = (floor * float(sel.sqrt().mean())) ** 2
        if math.isfinite(low) and low > 0.0:
            if where is None:
                v.clamp_min_(low)
            else:
                v.copy_(torch.where(where, v.clamp_min(low), v))
    return v


def known_mask(state: dict) -> torch.Tensor:
    """Bool mask of the elements whose variance is frozen, from Adam's own state (nothing of ours is stored):
    ``exp_avg == 0`` (a frozen element's first moment is kept at 0: its update is applied by the pre-hook) and
    ``exp_avg_sq > 0`` (it has a variance). An element on Adam's own update has a non-zero first moment; should
    it reach exactly 0 (underflow after thousands of steps without gradient) it joins with its own variance,
    as a refresh would let it."""
    return (state["exp_avg"] == 0) & (state["exp_avg_sq"] > 0)


def bias_correction2(beta2: float, t: float, corrected: bool) -> float:
    """``1 − β2^t`` (1.0 where the optimizer does not bias-correct, e.g. FusedAdam ``bias_correction=False``)."""
    return (1.0 - beta2 ** t) if corrected else 1.0


def before_decay(vhat: torch.Tensor, beta2: float) -> torch.Tensor:
    """``v`` such that Adam's ``v·β2`` (``exp_avg_sq.mul_(β2)``, the gradient being 0) lands on ``vhat``: the
    quotient, moved one ulp where its product rounds past ``vhat``. Exact except just below a power of two,
    where products of consecutive values are 2 ulps apart (``vhat`` then moves by 1 ulp, once), and where the
    quotient overflows (``vhat`` within ``β2`` of the dtype's largest value: it then decays once)."""
    v = vhat / beta2
    back = v * beta2
    up = torch.nextafter(v, torch.full_like(v, math.inf))
    down = torch.nextafter(v, torch.zeros_like(v))
    return torch.where(torch.isinf(v), vhat, torch.where(back < vhat, up, torch.where(back > vhat, down, v)))


def momentum_step_(p: torch.Tensor, state: dict, g: torch.Tensor, known: Optional[torch.Tensor], beta2: float,
                   c1: float, lr: float, eps: float, decay: float) -> None:
    """Apply ``lr · (g / c1) / (sqrt(V̂) + eps)`` to the ``known`` elements of ``p`` now, and leave Adam nothing
    to do there: their gradient is zeroed (with ``exp_avg`` at 0 Adam's update is 0) and ``exp_avg_sq`` is set
    to :func:`before_decay` of ``V̂``, so that Adam's step puts ``V̂`` back. The other elements keep Adam's own
    update.

    Args:
        p: the parameter Adam steps (fp32 master at ZeRO), changed in place.
        state: Adam's state of ``p``: ``exp_avg_sq`` holds ``V̂`` at the known elements.
        g: the gradient Adam is about to apply (the averaged momentum), ``p``'s shape; zeroed where known.
        known: :func:`known_mask` (None: every element).
        c1: ``1 − β1^(t+1)`` of the step Adam is about to take.
        decay: AdamW's decoupled factor ``1 − lr·weight_decay`` (1.0 without), which Adam applies to ``p``
            after this: the update is divided by it, so that the result is ``decay·p − update`` as Adam's.
    """
    v = state["exp_avg_sq"]
    vhat = v if known is None else torch.where(known, v, torch.ones_like(v))
    update = g.to(v.dtype).div(vhat.sqrt().add_(eps)).mul_(lr / c1 / (decay if decay != 0.0 else 1.0))
    if known is None:
        p.data.sub_(update.to(p.dtype))
        g.zero_()
        v.copy_(before_decay(vhat, beta2))
    else:
        p.data.sub_(update.masked_fill_(~known, 0.0).to(p.dtype))
        g.masked_fill_(known, 0.0)
        v.copy_(torch.where(known, before_decay(vhat, beta2), v))


def refresh_(state: dict, g: torch.Tensor, beta2: float, c2: float, rho: float,
             floor: float = VARIANCE_FLOOR) -> int:
    """A variance refresh from the dense raw gradient ``g``, then no update. The known elements move
    ``V̂ ← ρ·V̂ + (1 − ρ)·g²``; an element on Adam's own update with a variance (``exp_avg_sq > 0``: momentum
    arrived for it) joins them with ``V̂ = max(own, g²)``, ``own = exp_avg_sq / c2`` its bias-corrected
    variance (one step's ``g²`` alone is often ~0 for a rare element); the known elements are floored at
    ``floor`` of their mean ``sqrt(V̂)``. The gradient and ``exp_avg`` are zeroed and ``exp_avg_sq`` set to
    :func:`before_decay` of ``V̂``, so that Adam applies no update (AdamW still decays the weights once) and
    its step puts ``V̂`` back. Returns how many elements joined.

    Args:
        c2: ``1 − β2^t`` of Adam's step count so far (its own bias correction of the joining elements).
    """
    v, m = state["exp_avg_sq"], state["exp_avg"]
    known = known_mask(state)
    g2 = g.to(v.dtype).square()
    joins = ~known & (v > 0)
    vhat = torch.where(known, v * rho + g2 * (1.0 - rho), torch.where(joins, torch.maximum(g2, v / c2), v))
    has = known | joins
    floor_variance_(vhat, floor, has)
    v.copy_(torch.where(has, before_decay(vhat, beta2), v))  # (the others have no variance: 0 stays 0)
    m.zero_()
    g.zero_()
    return int(joins.sum())


__all__ = ["DEFAULT_DECAY_FLOOR", "VARIANCE_FLOOR", "before_decay", "bias_correction2", "default_refresh_decay",
           "floor_variance_", "known_mask", "momentum_step_", "refresh_"]
