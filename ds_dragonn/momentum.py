"""Local momentum before error feedback: what the momentum mode (``"compress": "momentum"``) compresses.

1-bit Adam (Tang et al., ICML 2021; DeepSpeed <= 0.19.7 ``runtime/fp16/onebit/adam.py``) and DGC's momentum
correction (Lin et al., ICLR 2018) compress the momentum, not the gradient: each rank keeps its own momentum
``M ← β1·M + (1 − β1)·g`` of its local gradient, the residual accumulates ``M`` (error feedback on the
momentum), and what the ranks exchange is the averaged sparse momentum, which the optimizer then applies
with its variance frozen (``engine/adam.py``). Delays then act on the update itself: an element that waits
100 steps arrives with 100 steps of momentum, applied once, linearly, instead of being divided away by an
Adam variance inflated by the burst.

Per optimizer step the residual grows by exactly ``M_t``, whatever the gradient accumulation: the first
reduction of a bucket in a step decays and adds (``M ← β1·M + c·g``, residual += ``M``), later reductions
of the same step (ZeRO stage 2 reduces at every micro step) only add (``M += c·g``, residual += ``c·g``),
with ``c = (1 − β1) × prescale``. Invariant (tests check it in float64): everything applied plus all
residuals equals the sum over steps of the ranks' averaged momenta.

Learning-rate weighting (``lr_weighted_residual``, :meth:`LocalMomentum.follow_lr`): the residual grows by
``w_t·M_t`` with ``w_t = lr_t / lr_ref`` instead, and the pipeline divides what it hands the optimizer by ``w_t``
(:meth:`LocalMomentum.unweighted`), so that Adam, at ``lr_t``, applies ``lr_ref × Σ w_τ·M_τ = Σ lr_τ·M_τ``
for what waited: each step's momentum at its own step's learning rate, as dense Adam would (the memory of
EF-SGD, Karimireddy et al., ICML 2019, holds ``γ_t·g_t``). What the optimizer receives is in this step's
units (a fresh momentum as it is), so gradient clipping sees the scale it sees without the weighting. The
invariant reads: ``Σ_t w_t × (what was handed at step t) × ranks`` plus all residuals equals
``Σ_t w_t × Σ_ranks M_t``. A step at learning rate 0 (``w_t = 0``) hands 0: what it sent is lost (Adam
would not move at learning rate 0 either; schedules reach 0 after the last step).

Skipped steps (``transactional``): as for the residuals, the step's momentum is computed into a second
persistent buffer and becomes the momentum only when DeepSpeed applies the step (:meth:`end_step`).
Memory: one fp32 buffer per bucket element (two when transactional), beside the residual.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Sequence

import torch

from .buffers import persistent_zeros
from .feedback import residual_dtype, segment_views


class LocalMomentum:
    """Each bucket's local momentum ``M`` (this rank's, never exchanged), in :func:`residual_dtype`.

    Args:
        beta: the momentum coefficient β1 in [0, 1) (the optimizer's ``betas[0]``).
        transactional: a step's momentum stays in a working buffer until :meth:`end_step` says whether
            DeepSpeed applied the step.
        lr_weighted: the residual gets ``w_t·M_t`` (:meth:`follow_lr`), not ``M_t``.
    """

    def __init__(self, beta: float, transactional: bool = False, lr_weighted: bool = False):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"momentum coefficient must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self.transactional = transactional
        self.momenta: Dict[Hashable, torch.Tensor] = {}  # the momentum after the last applied step
        self._work: Dict[Hashable, torch.Tensor] = {}
        self._open: set = set()  # keys already updated in the open step
        self.lr_weighted = bool(lr_weighted)
        self.reference_lr: Optional[float] = None  # lr_ref: the first positive learning rate followed
        self.weight = 1.0  # w_t: what the residual gets of this step's momentum

    def update(self, key: Hashable, tensors: Sequence[torch.Tensor], dtype: torch.dtype,
               prescale: float = 1.0) -> tuple:
        """Fold this reduction's gradients into the key's momentum; returns ``(tensors, prescale)`` for
        :meth:`ErrorFeedback.compensate_ <ds_dragonn.feedback.ErrorFeedback.compensate_>`: ``([M], 1.0)`` on
        the step's first reduction of ``key``, ``(tensors, (1 − β1)·prescale)`` on later ones.

        Args:
            tensors: the bucket's gradients in bucket order (their concatenation is the (n,) bucket).
            dtype: the wire dtype (the momentum is kept in its :func:`residual_dtype`).
            prescale: the factor DeepSpeed's averaging applies to the gradients before the sum.
        Raises:
            ValueError: the key's momentum has another length, dtype or device.
        """
        tensors = list(tensors)
        numel = sum(t.numel() for t in tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        rdt = residual_dtype(dtype)
        base = self.momenta.get(key)
        if base is None:
            base = self.momenta[key] = persistent_zeros(numel, rdt, device)
        elif base.shape != (numel,) or base.dtype != rdt or base.device != device:
            raise ValueError(f"momentum for bucket {key} has shape {tuple(base.shape)}, dtype {base.dtype} on "
                             f"{base.device}; the buffer has ({numel},) of {rdt} on {device}")
        c = (1.0 - self.beta) * prescale
        first = key not in self._open
        self._open.add(key)
        if self.transactional:
            work = self._work.get(key)
            if work is None or work.shape != base.shape or work.dtype != base.dtype or work.device != device:
                work = self._work[key] = persistent_zeros(numel, rdt, device)
            if first:
                torch.mul(base, self.beta, out=work)
            m = work
        else:
            m = base
            if first:
                m.mul_(self.beta)
        if tensors:
            torch._foreach_add_(segment_views(m, tensors), tensors, alpha=c)
        return ([m], self.weight) if first else (tensors, c * self.weight)

    def follow_lr(self, lr: float) -> float:
        """Set this step's weight ``w_t = lr / lr_ref`` from the optimizer's learning rate ``lr`` (the
        largest over its parameter groups: one schedule scales them all); returns it. ``lr_ref`` is the first
        positive ``lr`` followed (kept in :meth:`state_dict`). 1.0 without ``lr_weighted``, and until a
        positive ``lr`` is seen; 0.0 for a step at learning rate 0.

        Raises:
            ValueError: ``lr`` is negative or not finite.
        """
        lr = float(lr)
        if not (lr >= 0.0 and lr < float("inf")):
            raise ValueError(f"the learning rate must be finite and >= 0 to weight the residual, got {lr}")
        if not self.lr_weighted:
            return self.weight
        if self.reference_lr is None and lr > 0.0:
            self.reference_lr = lr
        self.weight = lr / self.reference_lr if self.reference_lr else 1.0
        return self.weight

    def unweighted(self, postscale: float) -> float:
        """``postscale / w_t`` (0.0 at ``w_t = 0``): the factor that hands the optimizer this step's units."""
        if self.weight == 1.0:
            return postscale
        return postscale / self.weight if self.weight > 0.0 else 0.0

    def end_step(self, applied: bool) -> None:
        """The step ended: transactional, an applied step's momenta replace the old (a swap), a skipped
        step's are discarded. Either way the next reduction starts a new step."""
        if self.transactional and applied:
            for key in self._open:
                self.momenta[key], self._work[key] = self._work[key], self.momenta[key]
        self._open.clear()

    def rescale_(self, factor: float) -> None:
        """Multiply every momentum by ``factor`` (a changed fp16 loss scale, as the residuals)."""
        if factor != 1.0:
            for m in self.momenta.values():
                m.mul_(factor)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "momenta": {k: v.detach().clone() for k, v in self.momenta.items()},
                "reference_lr": self.reference_lr}

    def load_state_dict(self, state: dict, device: Optional[torch.device] = None) -> None:
        """Restore :meth:`state_dict` (tensors onto ``device`` if given); β1 stays as configured. ``lr_ref``
        too, where this momentum is ``lr_weighted`` (a state without one takes the next learning rate)."""
        self.momenta = {k: v.to(device).clone() if device is not None else v.clone()
                        for k, v in state.get("momenta", {}).items()}
        ref = state.get("reference_lr")
        self.reference_lr = float(ref) if ref is not None and self.lr_weighted else None
        self._work.clear()
        self._open.clear()

    def reset(self) -> None:
        self.momenta.clear()
        self.reference_lr = None
        self.weight = 1.0
        self._work.clear()
        self._open.clear()


__all__ = ["LocalMomentum"]
