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

Skipped steps (``transactional``): as for the residuals, the step's momentum is computed into a second
persistent buffer and becomes the momentum only when DeepSpeed applies the step (:meth:`end_step`).
Memory: one fp32 buffer per bucket element (two when transactional), beside the residual.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Sequence

import torch

from .buffers import persistent_zeros
from .feedback import residual_dtype, segment_views


_MIN_EPS = 1e-20  # an optimizer eps of 0 would score 0/0 = NaN where nothing moved yet (NaN ranks first)


class LocalMomentum:
    """Each bucket's local momentum ``M`` (this rank's, never exchanged), in :func:`residual_dtype`.

    Args:
        beta: the momentum coefficient β1 in [0, 1) (the optimizer's ``betas[0]``).
        transactional: a step's momentum stays in a working buffer until :meth:`end_step` says whether
            DeepSpeed applied the step.
    """

    def __init__(self, beta: float, transactional: bool = False, beta2: Optional[float] = None,
                 eps: float = 1e-8):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"momentum coefficient must be in [0, 1), got {beta}")
        if beta2 is not None and not 0.0 <= beta2 < 1.0:
            raise ValueError(f"second-moment coefficient must be in [0, 1), got {beta2}")
        self.beta = float(beta)
        self.beta2 = None if beta2 is None else float(beta2)
        self.eps = max(float(eps), _MIN_EPS)
        self.transactional = transactional
        self.momenta: Dict[Hashable, torch.Tensor] = {}  # the momentum after the last applied step
        self.variances: Dict[Hashable, torch.Tensor] = {}  # beta2: the local second moment, likewise
        self._work: Dict[Hashable, torch.Tensor] = {}
        self._vwork: Dict[Hashable, torch.Tensor] = {}
        self._open: set = set()  # keys already updated in the open step

    def _target(self, store: dict, work: dict, key: Hashable, numel: int, rdt: torch.dtype, device: torch.device,
                decay: float, first: bool, what: str) -> torch.Tensor:
        """The buffer this step writes for ``key``: ``store[key]`` (decayed on the step's first reduction), or,
        transactional, a working copy that :meth:`end_step` keeps only for an applied step."""
        base = store.get(key)
        if base is None:
            base = store[key] = persistent_zeros(numel, rdt, device)
        elif base.shape != (numel,) or base.dtype != rdt or base.device != device:
            raise ValueError(f"{what} for bucket {key} has shape {tuple(base.shape)}, dtype {base.dtype} on "
                             f"{base.device}; the buffer has ({numel},) of {rdt} on {device}")
        if not self.transactional:
            if first:
                base.mul_(decay)
            return base
        buf = work.get(key)
        if buf is None or buf.shape != base.shape or buf.dtype != base.dtype or buf.device != device:
            buf = work[key] = persistent_zeros(numel, rdt, device)
        if first:
            torch.mul(base, decay, out=buf)
        return buf

    def update(self, key: Hashable, tensors: Sequence[torch.Tensor], dtype: torch.dtype,
               prescale: float = 1.0) -> tuple:
        """Fold this reduction's gradients into the key's momentum; returns ``(tensors, prescale)`` for
        :meth:`ErrorFeedback.compensate_ <ds_dragonn.feedback.ErrorFeedback.compensate_>`: ``([M], 1.0)`` on
        the step's first reduction of ``key``, ``(tensors, (1 − β1)·prescale)`` on later ones. With ``beta2``
        the step's first reduction also folds ``(prescale·g)²`` into the local second moment (later
        reductions of a step, ZeRO stage 2's micro steps, are not: it only ranks elements, see :meth:`scores`).

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
        c = (1.0 - self.beta) * prescale
        first = key not in self._open
        self._open.add(key)
        m = self._target(self.momenta, self._work, key, numel, rdt, device, self.beta, first, "momentum")
        if tensors:
            torch._foreach_add_(segment_views(m, tensors), tensors, alpha=c)
        if self.beta2 is not None and first:
            v = self._target(self.variances, self._vwork, key, numel, rdt, device, self.beta2, True, "second moment")
            if tensors:
                torch._foreach_addcmul_(segment_views(v, tensors), tensors, tensors,
                                        value=(1.0 - self.beta2) * prescale * prescale)
        return ([m], 1.0) if first else (tensors, c)

    def scores(self, key: Hashable, compensated: torch.Tensor) -> Optional[torch.Tensor]:
        """What the selection ranks under ``select_by: update``: ``compensated / (sqrt(ν) + eps)``, the Adam
        step each element has pending, with ``ν`` this rank's second moment of its gradients (this step's,
        after :meth:`update`; ``eps`` at least 1e-20). None without ``beta2``, or before ``key`` has one.
        Two temporaries of the bucket's size (the root and the quotient).

        Args:
            compensated: (n,) the residual plus this step's momentum, in bucket order.
        Returns:
            (n,) float tensor of the same sign as ``compensated`` (a new buffer), or None.
        """
        if self.beta2 is None:
            return None
        v = (self._vwork if self.transactional else self.variances).get(key)
        if v is None or v.shape != compensated.shape:
            return None
        return compensated / v.sqrt().add_(self.eps)

    def end_step(self, applied: bool) -> None:
        """The step ended: transactional, an applied step's momenta replace the old (a swap), a skipped
        step's are discarded. Either way the next reduction starts a new step."""
        if self.transactional and applied:
            for store, work in ((self.momenta, self._work), (self.variances, self._vwork)):
                for key in self._open & work.keys():
                    store[key], work[key] = work[key], store[key]
        self._open.clear()

    def rescale_(self, factor: float) -> None:
        """Multiply every momentum by ``factor`` and every second moment by ``factor²`` (a changed fp16 loss
        scale, as the residuals)."""
        if factor != 1.0:
            for m in self.momenta.values():
                m.mul_(factor)
            for v in self.variances.values():
                v.mul_(factor * factor)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "momenta": {k: v.detach().clone() for k, v in self.momenta.items()},
                "variances": {k: v.detach().clone() for k, v in self.variances.items()}}

    def load_state_dict(self, state: dict, device: Optional[torch.device] = None) -> None:
        """Restore :meth:`state_dict` (tensors onto ``device`` if given); β1 and β2 stay as configured."""
        def restore(d):
            return {k: v.to(device).clone() if device is not None else v.clone() for k, v in d.items()}
        self.momenta = restore(state.get("momenta", {}))
        self.variances = restore(state.get("variances", {}) if self.beta2 is not None else {})
        self._work.clear()
        self._vwork.clear()
        self._open.clear()

    def reset(self) -> None:
        for d in (self.momenta, self.variances, self._work, self._vwork):
            d.clear()
        self._open.clear()


__all__ = ["LocalMomentum"]
