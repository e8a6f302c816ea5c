"""The arithmetic of the momentum mode's frozen Adam variance, one pure function per step (``engine/variance.py``
holds the optimizer hook). See docs/design.md, 'The data path of one bucket' (What is compressed).

``V̂`` lives in Adam's own ``exp_avg_sq``; the frozen elements are those whose ``exp_avg`` is kept at 0
(:func:`known_mask`). Elements without a variance keep Adam's own update until a refresh (:func:`refresh_`).
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

#: each tensor's frozen ``sqrt(V̂)`` is at least this fraction of its mean over the known elements
VARIANCE_FLOOR = 0.01

#: elements per chunk of the freeze's elementwise work (its temporaries are a few float32 copies of a chunk)
CHUNK = 1 << 20

#: the least weight the frozen variance keeps at a refresh (one step's g² is a one-sample estimate)
DEFAULT_DECAY_FLOOR = 0.9


def default_refresh_decay(beta2: float, refresh_steps: int) -> float:
    """``ρ`` of a variance refresh: ``max(β2^refresh_steps, DEFAULT_DECAY_FLOOR)``."""
    return max(beta2 ** max(refresh_steps, 1), DEFAULT_DECAY_FLOOR)


def slices(numel: int, chunk: int = CHUNK) -> Iterator[slice]:
    """Consecutive slices of ``[0, numel)``, ``chunk`` elements each (the last shorter)."""
    for start in range(0, numel, chunk):
        yield slice(start, min(numel, start + chunk))


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D view (ValueError for a tensor that has no such view)."""
    if not t.is_contiguous():
        raise ValueError(f"the variance freeze needs contiguous optimizer tensors; got one of shape {tuple(t.shape)} "
                         f"with strides {t.stride()}")
    return t.view(-1)


def known_mask(state: dict) -> torch.Tensor:
    """Bool mask of the elements whose variance is frozen, from Adam's own state: ``exp_avg == 0`` and
    ``exp_avg_sq > 0``."""
    return (state["exp_avg"] == 0) & (state["exp_avg_sq"] > 0)


def bias_correction2(beta2: float, t: float, corrected: bool) -> float:
    """``1 − β2^t`` (1.0 where the optimizer does not bias-correct, e.g. FusedAdam ``bias_correction=False``)."""
    return (1.0 - beta2 ** t) if corrected else 1.0


def before_decay(vhat: torch.Tensor, beta2: float) -> torch.Tensor:
    """``v`` such that Adam's ``v·β2`` (``exp_avg_sq.mul_(β2)``, the gradient being 0) lands on ``vhat``: the
    quotient, moved one ulp where its product rounds past ``vhat`` (exact except just below a power of two)."""
    v = vhat / beta2
    back = v * beta2
    up = torch.nextafter(v, torch.full_like(v, math.inf))
    down = torch.nextafter(v, torch.zeros_like(v))
    return torch.where(torch.isinf(v), vhat, torch.where(back < vhat, up, torch.where(back > vhat, down, v)))


class _RootMean:
    """Running mean of ``sqrt(V̂)`` over the elements with a variance, chunk by chunk (on the device: one
    read-back at the end), for the floor."""

    def __init__(self, like: torch.Tensor):
        self.total = torch.zeros((), dtype=torch.float64, device=like.device)
        self.count = torch.zeros((), dtype=torch.int64, device=like.device)

    def add(self, vhat: torch.Tensor) -> None:
        has = vhat > 0
        self.total += torch.where(has, vhat.sqrt(), 0.0).sum(dtype=torch.float64)
        self.count += has.sum()

    def low(self, floor: float) -> Optional[float]:
        """``(floor × mean sqrt(V̂))²``, or None where it is no floor (none known, 0 or not finite)."""
        if floor <= 0.0:
            return None
        total, count = torch.stack([self.total, self.count.to(torch.float64)]).tolist()
        low = (floor * total / count) ** 2 if count else 0.0
        return low if math.isfinite(low) and low > 0.0 else None


def _floor_(vf: torch.Tensor, low: Optional[float], beta2: Optional[float] = None, chunk: int = CHUNK) -> None:
    """Second pass: raise the elements with a variance to ``low`` (None: none), then, with ``beta2``, set them
    to :func:`before_decay` of the result."""
    if low is None and beta2 is None:
        return
    for sl in slices(vf.numel(), chunk):
        x = vf[sl]
        has = x > 0
        y = x.clamp_min(low) if low is not None else x
        x.copy_(torch.where(has, before_decay(y, beta2) if beta2 is not None else y, x))


def floor_variance_(v: torch.Tensor, floor: float, chunk: int = CHUNK) -> torch.Tensor:
    """Raise ``v``'s elements with a variance (``> 0``) in place to ``(floor × mean sqrt(v))²``, the mean over
    those elements, as the freeze does (:func:`record_`); returns ``v``. Shape and dtype any (float)."""
    vf = flat(v)
    roots = _RootMean(vf)
    for sl in slices(vf.numel(), chunk):
        roots.add(vf[sl])
    _floor_(vf, roots.low(floor), None, chunk)
    return v


def momentum_step_(p: torch.Tensor, state: dict, g: torch.Tensor, every: bool, beta2: float, c1: float, lr: float,
                   eps: float, decay: float, chunk: int = CHUNK) -> None:
    """Apply ``lr · (g / c1) / (sqrt(V̂) + eps)`` to the known elements of ``p`` now, and leave Adam nothing to do
    there (gradient zeroed, ``exp_avg_sq`` set to :func:`before_decay` of ``V̂``). The other elements keep Adam's
    own update. Chunk by chunk.

    Args:
        p: the parameter Adam steps (fp32 master at ZeRO), changed in place; contiguous, as ``state``'s and ``g``.
        state: Adam's state of ``p``: ``exp_avg_sq`` holds ``V̂`` at the known elements (:func:`known_mask`).
        g: the gradient Adam is about to apply (the averaged momentum), ``p``'s shape; zeroed where known.
        every: every element is known (no mask).
        c1: ``1 − β1^(t+1)`` of the step Adam is about to take.
        decay: AdamW's decoupled factor ``1 − lr·weight_decay`` (1.0 without), which Adam applies to ``p``
            after this: the update is divided by it, so that the result is ``decay·p − update`` as Adam's.
    Raises:
        ValueError: a tensor is not contiguous.
    """
    pf, gf = flat(p.data), flat(g)
    mf, vf = flat(state["exp_avg"]), flat(state["exp_avg_sq"])
    scale = lr / c1 / (decay if decay != 0.0 else 1.0)
    for sl in slices(pf.numel(), chunk):
        v = vf[sl]
        known = None if every else known_mask({"exp_avg": mf[sl], "exp_avg_sq": v})
        vhat = v if known is None else torch.where(known, v, 1.0)
        update = gf[sl].to(v.dtype).div(vhat.sqrt().add_(eps)).mul_(scale)
        if known is None:
            pf[sl].sub_(update.to(pf.dtype))
            gf[sl].zero_()
            v.copy_(before_decay(vhat, beta2))
        else:
            pf[sl].sub_(update.masked_fill_(~known, 0.0).to(pf.dtype))
            gf[sl].masked_fill_(known, 0.0)
            v.copy_(torch.where(known, before_decay(vhat, beta2), v))


def refresh_(state: dict, g: torch.Tensor, beta2: float, c2: float, rho: float,
             floor: float = VARIANCE_FLOOR, chunk: int = CHUNK) -> int:
    """A variance refresh from the dense raw gradient ``g``, then no update: known elements move
    ``V̂ ← ρ·V̂ + (1 − ρ)·g²``; an element on Adam's own update with a variance joins them with
    ``V̂ = max(exp_avg_sq / c2, g²)``; floored at ``floor`` of the mean ``sqrt(V̂)``. Gradient and ``exp_avg``
    are zeroed and ``exp_avg_sq`` set to :func:`before_decay` of ``V̂``. Returns how many elements joined.

    Args:
        c2: ``1 − β2^t`` of Adam's step count so far (its own bias correction of the joining elements).
    """
    vf, mf, gf = flat(state["exp_avg_sq"]), flat(state["exp_avg"]), flat(g)
    joined = torch.zeros((), dtype=torch.int64, device=vf.device)
    roots = _RootMean(vf)
    for sl in slices(vf.numel(), chunk):
        v = vf[sl]
        known = known_mask({"exp_avg": mf[sl], "exp_avg_sq": v})
        g2 = gf[sl].to(v.dtype).square()
        joins = ~known & (v > 0)
        v.copy_(torch.where(known, v * rho + g2 * (1.0 - rho), torch.where(joins, torch.maximum(g2, v / c2), v)))
        joined += joins.sum()
        roots.add(v)  # the known and the joined elements: the others have no variance (0 stays 0)
    _floor_(vf, roots.low(floor), beta2, chunk)
    mf.zero_()
    gf.zero_()
    return int(joined)


def record_(state: dict, c2: float, floor: float = VARIANCE_FLOOR, chunk: int = CHUNK) -> int:
    """The freeze: ``V̂ = exp_avg_sq / c2`` into ``exp_avg_sq`` (floored at ``floor`` of the mean ``sqrt(V̂)``) and
    ``exp_avg`` zeroed where it is > 0; elements that hold a frozen ``V̂`` already (:func:`known_mask`: a state a
    load kept or restored) keep it. Two passes, chunk by chunk. Returns how many elements have no variance."""
    vf, mf = flat(state["exp_avg_sq"]), flat(state["exp_avg"])
    roots = _RootMean(vf)
    for sl in slices(vf.numel(), chunk):
        v = vf[sl]
        already = known_mask({"exp_avg": mf[sl], "exp_avg_sq": v})
        v.copy_(torch.where(already, v, v / c2))
        mf[sl].masked_fill_(v > 0, 0.0)
        roots.add(v)
    _floor_(vf, roots.low(floor), None, chunk)
    return vf.numel() - int(roots.count)


__all__ = ["CHUNK", "DEFAULT_DECAY_FLOOR", "VARIANCE_FLOOR", "before_decay", "bias_correction2", "default_refresh_decay",
           "flat", "known_mask", "momentum_step_", "record_", "refresh_", "slices"]
