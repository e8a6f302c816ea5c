"""Local momentum before error feedback: what the momentum mode (``"compress": "momentum"``) compresses.

1-bit Adam (Tang et al., ICML 2021; DeepSpeed <= 0.19.7 ``runtime/fp16/onebit/adam.py``) and DGC's momentum
correction (Lin et al., ICLR 2018) compress the momentum, not the gradient: each rank keeps its own
``M ← β1·M + (1 − β1)·g``, the residual accumulates ``M``, and the optimizer applies the averaged sparse momentum
with its variance frozen. Per optimizer step the residual grows by exactly ``M_t``, whatever the gradient
accumulation (later reductions of a step only add ``c·g``, ``c = (1 − β1) × prescale``). Skipped steps:
``ds_dragonn.undo``. See docs/design.md, 'The data path of one bucket' (What is compressed).
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Sequence

import torch

from .buffers import persistent_zeros
from .feedback import residual_dtype, segment_views
from .undo import ReturnSent, for_steps


class LocalMomentum:
    """Each bucket's local momentum ``M`` (this rank's, never exchanged), in :func:`residual_dtype`.

    Args:
        beta: the momentum coefficient β1 in [0, 1) (the optimizer's ``betas[0]``).
        transactional: a step's momentum stays in a working buffer until :meth:`end_step` says whether
            DeepSpeed applied the step.
    """

    def __init__(self, beta: float, transactional: bool = False):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"momentum coefficient must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self.momenta: Dict[Hashable, torch.Tensor] = {}  # the momentum after the last applied step
        self.undo = for_steps(transactional, ReturnSent)  # (its keys opened: already updated in the open step)

    def update(self, key: Hashable, tensors: Sequence[torch.Tensor], dtype: torch.dtype,
               prescale: float = 1.0, zero_inputs: bool = False) -> tuple:
        """Fold this reduction's gradients into the key's momentum; returns ``(tensors, prescale)`` for
        :meth:`ErrorFeedback.compensate_ <ds_dragonn.feedback.ErrorFeedback.compensate_>`: ``([M], 1.0)`` on
        the step's first reduction of ``key``, ``(tensors, (1 − β1)·prescale)`` on later ones.

        Args:
            tensors: the bucket's gradients in bucket order (their concatenation is the (n,) bucket).
            dtype: the wire dtype (the momentum is kept in its :func:`residual_dtype`).
            prescale: the factor DeepSpeed's averaging applies to the gradients before the sum.
            zero_inputs: on the step's first reduction of ``key`` (the gradients are then folded into ``M``
                and not needed again), also set them to 0, for a decode straight into them; later reductions
                return the gradients themselves, which the compensation zeroes.
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
        first = key not in self.undo.opened
        m, src = self.undo.open(key, base)
        if first:
            torch.mul(src, self.beta, out=m)
        if tensors:
            torch._foreach_add_(segment_views(m, tensors), tensors, alpha=c)
            if zero_inputs and first:
                torch._foreach_zero_(tensors)
        return ([m], 1.0) if first else (tensors, c)

    def end_step(self, applied: bool) -> None:
        """The step ended: transactional, an applied step's momenta replace the old (a swap), a skipped
        step's are discarded; in place, a skipped step's gradient stays in the momenta and their non-finite
        entries are reset to 0 (one pass, skipped steps only). Either way the next reduction starts a new step."""
        self.undo.end_step(self.momenta, applied)

    def rescale_(self, factor: float) -> None:
        """Multiply every momentum by ``factor`` (a changed fp16 loss scale, as the residuals)."""
        if factor != 1.0:
            for m in self.momenta.values():
                m.mul_(factor)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "momenta": {k: v.detach().clone() for k, v in self.momenta.items()}}

    def load_state_dict(self, state: dict, device: Optional[torch.device] = None) -> None:
        """Restore :meth:`state_dict` (tensors onto ``device`` if given; None: start at 0); β1 stays as configured."""
        self.momenta = {k: v.to(device).clone() if device is not None else v.clone()
                        for k, v in (state or {}).get("momenta", {}).items()}
        self.undo.clear()

    def reset(self) -> None:
        self.momenta.clear()
        self.undo.clear()


__all__ = ["LocalMomentum"]
