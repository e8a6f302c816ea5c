"""The arithmetic of the momentum mode's frozen Adam variance, one pure function per step (``engine/variance.py``
holds the state and the optimizer hook).

Per parameter tensor the freeze keeps ``V̂`` (Adam's bias-corrected variance, recorded at the end of the
dense warm-up, then moved by variance refreshes) and ``known``, a bool mask of the elements that had gradient
before the freeze (``V̂ > 0``; floored at :data:`VARIANCE_FLOOR` of the tensor's mean ``sqrt(V̂)``). The other
elements had none (a rare token's embedding row, a layer or expert that first gets gradient later): they have
no variance to divide by. Dividing their momentum by the floor would move them by hundreds of learning rates
per step, where Adam's own update stays near one (docs/results.md). They keep Adam's own
update instead, its own moments following what arrives (bounded like Adam's), until a variance refresh gives
them an estimate (:func:`refresh_`).
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


def known_mask(vhat: torch.Tensor) -> torch.Tensor:
    """Bool mask (``vhat``'s shape) of the elements with a variance (``vhat > 0``: they had gradient)."""
    return vhat > 0


def bias_correction2(beta2: float, t: float, corrected: bool) -> float:
    """``1 − β2^t`` (1.0 where the optimizer does not bias-correct, e.g. FusedAdam ``bias_correction=False``)."""
    return (1.0 - beta2 ** t) if corrected else 1.0


def momentum_step_(state: dict, g: torch.Tensor, frozen: torch.Tensor, known: Optional[torch.Tensor], beta1: float,
                   beta2: float, c2: float, eps: float, all_known: Optional[bool] = None) -> None:
    """Set Adam's moments of the ``known`` elements so that its update is ``lr · (g / c1) / (sqrt(V̂) + eps)``:
    ``g`` (the averaged momentum) divided by the frozen denominator. The variance lands on
    ``V̂·c2 + (1 − β2)·g²`` (never below ``V̂·c2``: no cancellation, no negative variance however large a
    burst), and the first moment on ``g`` times the ratio of that denominator to the frozen one. The other
    elements keep Adam's own moments (module docstring).

    Args:
        state: Adam's per-parameter state (``exp_avg``, ``exp_avg_sq``), changed in place.
        g: the gradient Adam is about to apply (the averaged momentum), ``frozen``'s shape.
        c2: ``1 − β2^(t+1)`` of the step Adam is about to take.
        known: the known mask (may be None where ``all_known`` is True).
        all_known: ``known.all()`` where the caller already holds it on the host (None: read it back here).
    """
    v, m = state["exp_avg_sq"], state["exp_avg"]
    new_v = frozen.mul(c2 / beta2)
    denom = frozen.mul(c2).addcmul_(g, g, value=1.0 - beta2).div_(c2).sqrt_().add_(eps)
    denom.div_(frozen.sqrt().add_(eps))  # Adam's denominator over the frozen one (>= 1)
    new_m = g.mul(denom).sub_(g, alpha=1.0 - beta1).div_(beta1)
    if (bool(known.all()) if all_known is None else all_known):
        v.copy_(new_v)
        m.copy_(new_m)
    else:
        v.copy_(torch.where(known, new_v, v))
        m.copy_(torch.where(known, new_m, m))


def refresh_(frozen: torch.Tensor, known: torch.Tensor, g: torch.Tensor, own_vhat: Optional[torch.Tensor],
             rho: float, floor: float = VARIANCE_FLOOR) -> int:
    """A variance refresh from the dense raw gradient ``g``: the known elements move ``V̂ ← ρ·V̂ + (1 − ρ)·g²``
    (then floored at ``floor`` of the known mean ``sqrt(V̂)``); an unknown element gets
    ``V̂ = max(own, g²)``, ``own`` being Adam's own bias-corrected variance of it (of what arrived since it
    started; None: no Adam state yet), and joins the known ones where momentum arrived for it (``own > 0``: one
    step's ``g²`` alone is often ~0 for a rare element); then the known elements are floored at ``floor`` of
    their mean ``sqrt(V̂)``. Returns how many elements joined.
    """
    g2 = g.to(frozen.dtype).square()
    had = known.clone()
    if bool(had.any()):
        frozen.copy_(torch.where(had, frozen * rho + g2 * (1.0 - rho), frozen))
    if bool(had.all()):
        floor_variance_(frozen, floor)
        return 0
    if own_vhat is None:  # nothing arrived yet: no estimate beyond one step's g², which may be ~0
        return 0
    own = own_vhat.to(frozen.dtype)
    cand = torch.maximum(g2, own)
    joins = ~had & (own > 0)
    frozen.copy_(torch.where(joins, cand, frozen))
    known.logical_or_(joins)
    floor_variance_(frozen, floor, known)
    return int(joins.sum())


def no_update_(state: dict, frozen: torch.Tensor, known: torch.Tensor, g: torch.Tensor, beta2: float,
               corrected: bool, step: Optional[float]) -> None:
    """A refresh step applies no update: the gradient and ``exp_avg`` zeroed (``m_t = β1·0 + (1 − β1)·0``); the
    known elements' variance set so that it lands on ``V̂·c2``, the others' kept where it is. A parameter
    without Adam state yet gets it from Adam itself, zero (its first update is then 0 too)."""
    if "exp_avg_sq" in state and "exp_avg" in state:
        c2 = bias_correction2(beta2, step + 1.0, corrected) if step is not None else 1.0
        v = state["exp_avg_sq"]
        v.copy_(torch.where(known, frozen * (c2 / beta2), v / beta2))
        state["exp_avg"].zero_()
    g.zero_()


__all__ = ["DEFAULT_DECAY_FLOOR", "VARIANCE_FLOOR", "bias_correction2", "default_refresh_decay", "floor_variance_",
           "known_mask", "momentum_step_", "no_update_", "refresh_"]
