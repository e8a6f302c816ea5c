"""The parts of a hook that follow the engine's optimizer: the online end of the dense warm-up
(``"warmup_steps": "auto"`` without a readable scheduler) and the momentum mode's steps (the local momentum,
the variance freeze and its refreshes). A mixin of :class:`~ds_dragonn.engine.base.HookBase`, which owns the
fields it reads (``engine``, ``decision``, ``momentum``, ``variance_freeze``, ``error_feedback``,
``warmup_tracker``, ``pending``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Hashable, Optional

import torch
from deepspeed.utils.logging import print_dist

from ..schedule import UNDECIDED
from .adam import adam_beta1, optimizer_lr

if TYPE_CHECKING:
    from ..pipeline import CompressedAllreduce


class FollowsOptimizer:
    """The optimizer-following methods of :class:`~ds_dragonn.engine.base.HookBase` (module docstring)."""

    def _sends_momentum(self, step: int) -> bool:
        """Momentum mode after the dense warm-up: every reduction of this step, dense ones included, sends
        the local momentum (the optimizer applies what arrives as the momentum itself). No side effect: the
        reducer arms the variance freeze (``engine/reducer.py``)."""
        return self.momentum is not None and not self.decision.schedule.dense(step)

    def _refreshes(self, step: int) -> bool:
        """Momentum mode: ``step`` refreshes Adam's frozen variance (``schedule.refresh``): every bucket is
        reduced densely as the raw gradient (:meth:`_hold_momentum` first), whatever the decision."""
        freeze = self.variance_freeze  # without its optimizer pre-hook nothing would zero the step's update
        return freeze is not None and freeze.active and self.momentum is not None and self.decision.schedule.refresh(step)

    def _hold_momentum(self, key: Hashable, tensors, dtype: torch.dtype, prescale: float, pipeline=None) -> None:
        """A variance-refresh step, before DeepSpeed's dense reduction of the raw gradients: fold them into the
        local momentum and add this step's momentum to the residual, unsent (it goes out with later steps;
        transactional like every residual update)."""
        self.variance_freeze.arm()
        skey, tensors, prescale = _shard_view(pipeline, key, tensors, prescale)
        held, pre = self.momentum.update(skey, tensors, dtype, prescale)
        self.error_feedback.compensate_(skey, held, dtype, pre)
        self.pending.add(key)

    def _follow_optimizer(self) -> None:
        """At the start of every reduction: ``"warmup_steps": "auto"`` without a readable scheduler decides
        the end of the dense warm-up from this step's learning rate (``LrWarmupTracker``). Momentum mode: the
        local momentum follows the optimizer's current β1 (a scheduler may cycle it, e.g. OneCycle)."""
        tracker = self.warmup_tracker
        if tracker is not None and tracker.end is None:
            lr = optimizer_lr(self.engine) if hasattr(self.engine, "optimizer") else None
            skipped = int(getattr(self.engine, "skipped_steps", 0) or 0)
            if tracker.observe(int(self.engine.global_steps), lr, skipped) is not None:
                self._end_warmup(tracker.end, log=True)
        if self.momentum is None:
            return
        beta1 = adam_beta1(self.engine) if hasattr(self.engine, "optimizer") else None
        if beta1 is not None and 0.0 < beta1 < 1.0:
            self.momentum.beta = beta1

    def _track_momentum(self, pipeline: "CompressedAllreduce", key: Hashable, dtype: torch.dtype,
                        local: Callable[[], tuple]) -> None:
        """Momentum mode, dense warm-up: fold the local gradients (``local()``: ``(tensors, prescale)``, built
        in this mode only) into the local momentum (sent from the first compressed step on, so that it does
        not start from zero)."""
        if self.momentum is None:
            return
        tensors, prescale = local()
        if tensors:
            skey, tensors, prescale = _shard_view(pipeline, key, tensors, prescale)
            self.momentum.update(skey, tensors, dtype, prescale)

    #: whether ``"warmup_steps": "auto"`` may follow the learning rate online (else: the scheduler or 30)
    follows_lr = True

    def _end_warmup(self, end: int, log: bool = False) -> None:
        """The dense warm-up decided online ends at step ``end``: the schedule and the variance freeze follow."""
        self.decision.schedule.warmup_steps = end
        if self.variance_freeze is not None:
            self.variance_freeze.freeze_step = end
        if log:
            rise = self.warmup_tracker.last_rise
            why = f"the learning rate rose until step {rise}" if rise else "the learning rate did not rise"
            ramp = self.decision.schedule
            then = (f"; then the density falls to {ramp.density:g} over {ramp.steps} steps" if ramp.steps else "")
            print_dist(f"DRAGONN: warmup_steps 'auto': {why}; the dense warm-up ends at step {end} "
                       f"(max(30, 2 x {rise})){then}", ranks=[0])

    def load_warmup_state(self, saved: Optional[dict]) -> None:
        """Restore the online warm-up decision (``state_dict()["warmup"]``) where this hook follows one."""
        if self.warmup_tracker is None:
            return
        self.warmup_tracker.load_state_dict(saved)
        self._end_warmup(UNDECIDED if self.warmup_tracker.end is None else self.warmup_tracker.end)


def _shard_view(pipeline, key: Hashable, tensors, prescale: float) -> tuple:
    """``(key, tensors, prescale)`` as the pipeline keeps its residuals and momenta: unchanged for the flat
    pipeline, this rank's shard of the node's sum for the node-aware one (``NodeAllreduce.shard_view``: one
    dense allreduce inside the node)."""
    view = getattr(pipeline, "shard_view", None)
    return (key, tensors, prescale) if view is None else view(key, tensors, prescale)
