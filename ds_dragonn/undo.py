"""How a store's buffers come back from a step DeepSpeed skipped: one strategy per store, chosen when it is built.

A store (residuals, local momenta, the partitioned exchange's server residuals) keeps a dict of persistent (n,)
buffers by key. During a step it asks its strategy which buffer to write (:meth:`StepUndo.open`) and tells it what
is about to change (:meth:`StepUndo.save`) and what was sent (:meth:`StepUndo.sent`); :meth:`StepUndo.end_step`
keeps or undoes the step. Strategies: :class:`StepUndo` (nothing undone), :class:`WorkingCopies`,
:class:`SavedValues`, :class:`ReturnSent`. See docs/design.md, 'Around the step' (Skipped steps).
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Tuple

import torch

from . import sparse_ops
from .buffers import persistent_zeros


class StepUndo:
    """Nothing to undo; the base of the strategies (module docstring)."""

    returns_sent = False  # whether :meth:`sent` logs (a dense flush then logs what it sends: ``ReturnSent.add``)

    def __init__(self):
        self.opened: set = set()  # keys the open step wrote
        self.log: list = []  # the open step's record, (key, indices or None: all of the buffer, values) each

    def open(self, key: Hashable, base: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the buffer the open step writes for ``key``, the buffer it reads): ``(base, base)``, in place."""
        self.opened.add(key)
        return base, base

    def current(self, key: Hashable, base: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The buffer holding ``key``'s state in the open step (``base``: the store's own, or None)."""
        return base

    def save(self, key: Hashable, buf: torch.Tensor, indices: Optional[torch.Tensor]) -> None:
        """``buf`` (the store's buffer of ``key``) is about to change at ``indices`` (None: everywhere)."""

    def sent(self, key: Hashable, buf: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` (any dtype) left ``buf`` at ``indices`` this step."""

    def end_step(self, buffers: Dict[Hashable, torch.Tensor], applied: bool) -> None:
        """The step ended, applied or skipped; ``buffers`` is the store's dict (key -> buffer)."""
        self.clear()

    def forget(self, key: Hashable, buf: Optional[torch.Tensor] = None) -> None:
        """``key``'s buffer (``buf``) was released in the open step: dropped."""
        self.opened.discard(key)

    def clear(self) -> None:
        """No step is open any more, nothing to undo (also after a reset or a load)."""
        self.opened.clear()
        self.log.clear()


class WorkingCopies(StepUndo):
    """Exact: the step works on a second persistent buffer per key, swapped in when it is applied; a buffer
    released during the step comes back when it is skipped."""

    def __init__(self):
        super().__init__()
        self._work: Dict[Hashable, torch.Tensor] = {}
        self._released: Dict[Hashable, torch.Tensor] = {}  # buffers released in the open step (back if skipped)

    def open(self, key: Hashable, base: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(working buffer, base)`` on the step's first write of ``key``, then ``(working, working)``."""
        work = self._work.get(key)
        if work is None or work.shape != base.shape or work.dtype != base.dtype or work.device != base.device:
            work = self._work[key] = persistent_zeros(base.numel(), base.dtype, base.device)
        src = work if key in self.opened else base
        self.opened.add(key)
        return work, src

    def current(self, key: Hashable, base: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return self._work[key] if key in self.opened else base

    def end_step(self, buffers: Dict[Hashable, torch.Tensor], applied: bool) -> None:
        if applied:
            for key in self.opened:
                buffers[key], self._work[key] = self._work[key], buffers[key]
        else:
            buffers.update(self._released)
        self._released.clear()
        self.opened.clear()  # (the working buffers stay: the next step writes them again)

    def forget(self, key: Hashable, buf: Optional[torch.Tensor] = None) -> None:
        if buf is not None:
            self._released[key] = buf
        self._work.pop(key, None)
        self.opened.discard(key)

    def clear(self) -> None:
        super().clear()
        self._work.clear()
        self._released.clear()


class SavedValues(StepUndo):
    """Exact for sparse writes: the old values of each change, restored newest first when the step is skipped."""

    def save(self, key: Hashable, buf: torch.Tensor, indices: Optional[torch.Tensor]) -> None:
        if indices is None or indices.numel():
            self.log.append((key, indices, (buf if indices is None else buf[indices.long()]).clone()))

    def end_step(self, buffers: Dict[Hashable, torch.Tensor], applied: bool) -> None:
        if not applied:
            for key, idx, old in reversed(self.log):
                if idx is None:
                    buffers[key].copy_(old)
                else:
                    buffers[key][idx.long()] = old
        self.clear()


class ReturnSent(StepUndo):
    """O(k), in place: a skipped step's sent values return to the buffers, whose non-finite entries are reset."""

    returns_sent = True

    def sent(self, key: Hashable, buf: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
        self.add(key, indices.clone(), values.to(buf.dtype, copy=True))

    def add(self, key: Hashable, indices: Optional[torch.Tensor], values: torch.Tensor) -> None:
        """``values`` (kept as given: the caller's copy, in the buffer's dtype) left ``key``'s buffer at ``indices``
        (None: the whole buffer, a dense flush) this step."""
        self.log.append((key, indices, values))

    def end_step(self, buffers: Dict[Hashable, torch.Tensor], applied: bool) -> None:
        """Skipped: add the finite sent values back into ``buffers``, then reset the non-finite entries of the
        buffers the step wrote."""
        if applied:
            return self.clear()
        for key, idx, sent in self.log:
            buf = buffers.get(key)
            if buf is None or not buf.numel():
                continue
            sent = torch.nan_to_num(sent, nan=0.0, posinf=0.0, neginf=0.0)
            if idx is None:
                buf.add_(sent)
            elif idx.numel():
                sparse_ops.add_(buf, idx, sent)
        for key in self.opened:
            if key in buffers:
                buffers[key].masked_fill_(~torch.isfinite(buffers[key]), 0.0)
        self.clear()


def for_steps(transactional: bool, otherwise: type = StepUndo, exact: type = WorkingCopies) -> StepUndo:
    """A new ``exact`` strategy where skipped steps must leave no trace (``plan.step_transaction``), else a new
    ``otherwise``."""
    return exact() if transactional else otherwise()


__all__ = ["ReturnSent", "SavedValues", "StepUndo", "WorkingCopies", "for_steps"]
