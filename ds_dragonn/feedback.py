"""Error feedback: a residual per flattened buffer, so that nothing selected away is lost, only delayed.

Order (fixed in ``ds_dragonn.pipeline``, cf. GRACE's communicator template): :meth:`ErrorFeedback.compensate_`
→ compress → exchange → :meth:`ErrorFeedback.commit`, the commit only after the exchange succeeded.

Invariant, exactly (tests check it): ``scatter(sent) + residual == compensated``. Residuals of fp16/bf16 buffers
are float32; what was actually sent (in the wire dtype) is subtracted, so its rounding stays in the residual.
Skipped steps: the strategy chosen at construction (``ds_dragonn.undo``) keeps or undoes the step. See
docs/design.md, 'The data path of one bucket' and 'Around the step'.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence

import torch

from . import sparse_ops
from .buffers import persistent_zeros
from .undo import ReturnSent, StepUndo, for_steps


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp16/bf16 buffers, the buffer's own dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def segment_views(buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views of ``buf`` laid out like ``torch.cat([t.flatten() for t in tensors])``, shaped like each tensor."""
    views, off = [], 0
    for t in tensors:
        views.append(buf[off:off + t.numel()].view(t.shape))
        off += t.numel()
    return views


class ErrorFeedback:
    """Persistent per-bucket buffers: the residual (error feedback on) or a scratch buffer (off).

    Args:
        enabled: when False, :meth:`compensate_` returns ``prescale × gradient`` in a scratch buffer and
            :meth:`commit` keeps nothing (``residuals`` stays empty).
        transactional: a step's residual updates stay in a working buffer until :meth:`end_step` says
            whether DeepSpeed applied the step (docs/design.md, 'Around the step'); ``residuals`` holds the state
            after the last applied step.
        undo_sent: (not transactional) log what each commit sent, added back by ``end_step(False)``.
        undo: the skipped-step strategy (``ds_dragonn.undo``) instead of the one these switches choose; error
            feedback off keeps nothing to undo.
    """

    def __init__(self, enabled: bool = True, transactional: bool = False, undo_sent: bool = False,
                 undo: Optional[StepUndo] = None):
        self.enabled = enabled
        chosen = undo or for_steps(transactional, ReturnSent if undo_sent else StepUndo)
        self.undo = chosen if enabled else StepUndo()
        self.residuals: Dict[Hashable, torch.Tensor] = {}  # error feedback on: what was not sent yet
        self._scratch: Dict[Hashable, torch.Tensor] = {}  # error feedback off: the step's work buffer
        self._views: Dict[Hashable, tuple] = {}  # (buffer, shapes, segment views) per key

    @property
    def undo_sent(self) -> bool:
        """Whether a skipped step returns what it sent; the pipeline's dense flush then logs what it sends in
        :attr:`sent_log` (``ReturnSent.add``)."""
        return self.undo.returns_sent

    @property
    def sent_log(self) -> StepUndo:
        return self.undo

    def _buffer(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        store = self.residuals if self.enabled else self._scratch
        buf = store.get(key)
        if buf is None:
            buf = persistent_zeros(numel, dtype, device)
            store[key] = buf
        elif buf.shape != (numel,) or buf.device != device or buf.dtype != dtype:
            raise ValueError(f"residual for bucket {key} has shape {tuple(buf.shape)}, dtype {buf.dtype} on "
                             f"{buf.device}; the buffer has ({numel},) of {dtype} on {device}")
        return buf

    def buffer(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The key's persistent (numel,) buffer in :func:`residual_dtype` of ``dtype``, for sparse compensation:
        the residual when enabled, else a scratch buffer zeroed now.

        Raises:
            ValueError: the key's buffer has another length, dtype or device.
        """
        buf = self._buffer(key, numel, residual_dtype(dtype), device)
        if not self.enabled:
            buf.zero_()
        return buf

    def _views_of(self, key: Hashable, buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        shapes = tuple(t.shape for t in tensors)
        slot = (key, buf.data_ptr())  # transactional: a bucket's two buffers alternate
        cached = self._views.get(slot)
        if cached is None or cached[0] is not buf or cached[1] != shapes:
            cached = (buf, shapes, segment_views(buf, tensors))
            self._views[slot] = cached
        return cached[2]

    def current(self, key: Hashable) -> torch.Tensor:
        return self.undo.current(key, self.residuals[key])

    def compensate_(self, key: Hashable, tensors: Sequence[torch.Tensor], dtype: torch.dtype,
                    prescale: float = 1.0, zero_inputs: bool = False) -> torch.Tensor:
        """The compensated buffer ``residual + prescale × cat(tensors)``, computed in the residual itself.

        Args:
            key: the bucket's stable key.
            tensors: the bucket's gradients (any shapes, one device, float dtypes), in bucket order; the
                buffer is their concatenation (DeepSpeed's ``flatten``), never materialised.
            dtype: the wire (communication) dtype; the buffer is in ``residual_dtype(dtype)``.
            prescale: factor applied to the gradients (DeepSpeed's ``1/gradient_predivide_factor``).
            zero_inputs: also set the gradients to 0 (in the same pass on the CPU library's path), for a
                decode straight into them.
        Returns:
            The persistent (n,) buffer (do not keep it across steps: :meth:`commit` turns it back into the
            residual).
        Raises:
            ValueError: the key's buffer has another length, dtype or device.
        """
        tensors = list(tensors)
        numel = sum(t.numel() for t in tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        buf = self._buffer(key, numel, residual_dtype(dtype), device)
        work, src = self.undo.open(key, buf)  # (buf, buf) in place, else (working buffer, what it starts from)
        if not tensors:
            if src is not work:
                work.copy_(src)
            return work
        if self.enabled and sparse_ops.compensate_fast(work, tensors, prescale, zero_inputs, base=src):
            return work
        views = self._views_of(key, work, tensors)
        if not self.enabled:
            torch._foreach_copy_(views, tensors)
            if prescale != 1.0:
                torch._foreach_mul_(views, prescale)
        elif work is buf:  # in place
            torch._foreach_add_(views, tensors, alpha=prescale)  # (alpha 1.0: the same bits)
        else:  # a working buffer: the same single pass, out of place on the step's first reduction
            for w, b, t in zip(views, self._views_of(key, src, tensors), tensors):
                torch.add(b, t, alpha=prescale, out=w) if prescale != 1.0 else torch.add(b, t, out=w)
        if zero_inputs:
            torch._foreach_zero_(tensors)
        return work

    def end_step(self, applied: bool) -> None:
        """DeepSpeed applied the step or skipped it: the strategy keeps or undoes it."""
        self.undo.end_step(self.residuals, applied)

    def rescale_(self, factor: float, key: Optional[Hashable] = None) -> None:
        """Multiply every residual (or only ``key``'s, where it has one) by ``factor``: a changed fp16 loss
        scale, or the local-steps mode's decaying accumulator. One pass, only when ``factor != 1``."""
        if factor == 1.0:
            return
        for buf in (self.residuals.values() if key is None else
                    [self.residuals[key]] if key in self.residuals else []):
            buf.mul_(factor)

    def commit(self, key: Hashable, indices: torch.Tensor, kept: torch.Tensor, sent: torch.Tensor) -> None:
        """Residual at the sent positions ``= kept − sent`` (non-finite results → 0); the rest stays compensated.

        Args:
            indices: (c,) int32/int64 positions that were sent (distinct).
            kept: (c,) the compensated values at ``indices`` (the buffer's dtype).
            sent: (c,) what went on the wire (wire dtype; its rounding stays in the residual).
        """
        if not self.enabled or indices.numel() == 0:
            return
        buf = self.current(key)
        diff = kept.to(buf.dtype) - sent.to(buf.dtype)
        torch.nan_to_num_(diff, nan=0.0, posinf=0.0, neginf=0.0)
        self.undo.save(key, buf, indices)
        sparse_ops.set_(buf, indices, diff)
        self.undo.sent(key, buf, indices, sent)

    def clear_non_finite(self, key: Hashable, sent: Optional[torch.Tensor] = None,
                         sends_non_finite: bool = False) -> None:
        """Reset every non-finite residual entry to 0 (one full pass; needed only on overflow steps).

        With finite ``sent`` values of a compressor that ``sends_non_finite``, the buffer is finite and the pass
        is skipped."""
        if sent is not None and sends_non_finite and bool(torch.isfinite(sent).all()):
            return
        buf = self.undo.current(key, self.residuals.get(key)) if self.enabled else None
        if buf is not None:
            buf.masked_fill_(~torch.isfinite(buf), 0.0)

    def reset(self) -> None:
        for store in (self.undo, self.residuals, self._scratch, self._views):
            store.clear()

    def release(self, key: Hashable) -> None:
        """Free ``key``'s buffers; what its residual held is dropped (nothing to do where it holds none)."""
        held = [store.pop(key, None) for store in (self.residuals, self._scratch)]
        if any(buf is not None for buf in held):
            self.undo.forget(key, held[0])  # (exact steps: back if this step is skipped)
            self._views = {slot: v for slot, v in self._views.items() if slot[0] != key}

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "residuals": {k: v.detach().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict, device: Optional[torch.device] = None) -> None:
        """Restore residuals (the ``enabled`` switch stays as configured), on ``device`` if given."""
        self.residuals = {k: v.to(device).clone() if device is not None else v.clone()
                          for k, v in state["residuals"].items()}
        self._views.clear()
        self.undo.clear()
