"""The parts of a hook that follow the engine's optimizer: the online end of the dense warm-up
(``"warmup_steps": "auto"`` without a readable scheduler), a mixin of :class:`~ds_dragonn.engine.base.HookBase`,
which owns the fields it reads (``engine``, ``decision``, ``mode``, ``variance_freeze``, ``warmup_tracker``);
and the hook's mode, chosen once from ``compress`` (:data:`MODES`): :class:`GradientMode`, or
:class:`MomentumMode` (the local momentum, the variance freeze and its refreshes).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional

import torch
from deepspeed.utils.logging import print_dist

from ..config import CompressTarget
from ..momentum import LocalMomentum
from ..pipeline import GRADIENTS, CompressedAllreduce
from ..schedule import UNDECIDED
from .adam import adam_beta1, optimizer_lr
from .variance import VarianceFreeze


class GradientMode:
    """``compress: gradient``: every reduction sends the gradients themselves. The hook's mode (``HookBase.mode``);
    :class:`MomentumMode` has the same methods, documented there."""

    momentum = variance_freeze = None  # (the hook's ``momentum`` and ``variance_freeze``)
    target = GRADIENTS  # what the pipelines compress

    def __init__(self, engine: Any = None, schedule: Any = None, transactional: bool = False):
        pass

    def follow_beta(self, engine: Any) -> None:
        pass

    def refreshes(self, step: int) -> bool:
        return False

    def sends_momentum(self, step: int) -> bool:
        return False

    def track(self, pipeline: CompressedAllreduce, key: Hashable, dtype: torch.dtype, local: Callable) -> None:
        pass

    def refuse_unmodelled(self, step: int, what: str) -> None:
        pass


class MomentumMode(GradientMode):
    """``compress: momentum``: the local momentum (:class:`~ds_dragonn.momentum.LocalMomentum`, following the
    optimizer's β1), which the pipelines compress and every reduction after the dense warm-up sends, and Adam's
    variance freeze (:class:`~ds_dragonn.engine.variance.VarianceFreeze`, None for an engine without an
    optimizer) with its refreshes.

    Args:
        engine: the DeepSpeed engine (None in unit tests: β1 0.9, no freeze).
        schedule: the hook's :class:`~ds_dragonn.schedule.DensitySchedule` (its warm-up and refreshes).
        transactional: the momentum's updates are a step transaction (``steps.py``).
    """

    def __init__(self, engine: Any, schedule: Any, transactional: bool = False):
        has_optimizer = engine is not None and hasattr(engine, "optimizer")
        beta1 = adam_beta1(engine) if has_optimizer else None
        self.momentum = self.target = LocalMomentum(0.9 if beta1 is None else beta1, transactional=transactional)
        self.schedule = schedule
        if has_optimizer:
            self.variance_freeze = VarianceFreeze(engine, schedule.warmup_steps, refresh=schedule.refresh,
                                                  refresh_steps=schedule.refresh_steps)

    def follow_beta(self, engine: Any) -> None:
        """The local momentum follows the optimizer's current β1 (a scheduler may cycle it, e.g. OneCycle)."""
        beta1 = adam_beta1(engine) if hasattr(engine, "optimizer") else None
        if beta1 is not None and 0.0 < beta1 < 1.0:
            self.momentum.beta = beta1

    def refreshes(self, step: int) -> bool:
        """``step`` refreshes Adam's frozen variance (``schedule.refresh``): every bucket is reduced densely as
        the raw gradient (:meth:`hold` first), whatever the decision."""
        freeze = self.variance_freeze  # without its optimizer pre-hook nothing would zero the step's update
        return freeze is not None and freeze.active and self.schedule.refresh(step)

    def sends_momentum(self, step: int) -> bool:
        """After the dense warm-up every reduction of ``step``, dense ones included, sends the local momentum:
        the variance freeze is armed."""
        sends = not self.schedule.dense(step)
        if sends and self.variance_freeze is not None:
            self.variance_freeze.arm()
        return sends

    def hold(self, hook: Any, key: Hashable, tensors, dtype: torch.dtype, prescale: float, pipeline=None) -> None:
        """A variance-refresh step, before DeepSpeed's dense reduction of the raw gradients: fold them into the
        local momentum and add this step's momentum to ``hook``'s residual, unsent (it goes out with later steps;
        transactional like every residual update)."""
        self.variance_freeze.arm()
        skey, tensors, prescale = _shard_view(pipeline, key, tensors, prescale)
        held, pre = self.momentum.update(skey, tensors, dtype, prescale)
        hook.error_feedback.compensate_(skey, held, dtype, pre)
        hook.pending.add(key)

    def track(self, pipeline: CompressedAllreduce, key: Hashable, dtype: torch.dtype, local: Callable) -> None:
        """The dense warm-up: fold the local gradients (``local()``: ``(tensors, prescale)``) into the local
        momentum, so that it does not start from zero."""
        tensors, prescale = local()
        if tensors:
            skey, tensors, prescale = _shard_view(pipeline, key, tensors, prescale)
            self.momentum.update(skey, tensors, dtype, prescale)

    def refuse_unmodelled(self, step: int, what: str) -> None:
        """After the warm-up the momentum of ``what`` (gradients DeepSpeed's dense path reduces) would be lost.

        Raises:
            RuntimeError: ``step`` is past the dense warm-up.
        """
        if not self.schedule.dense(step):
            raise RuntimeError(f"'dragonn.compress': 'momentum' cannot carry the momentum of {what}; use "
                               f"'compress': 'gradient'")


#: the hook's mode per resolved ``compress`` (``auto``, unresolved: the gradient)
MODES = {CompressTarget.gradient: GradientMode, CompressTarget.momentum: MomentumMode}


class FollowsOptimizer:
    """The optimizer-following methods of :class:`~ds_dragonn.engine.base.HookBase` (module docstring)."""

    def _follow_optimizer(self) -> None:
        """At the start of every reduction: ``"warmup_steps": "auto"`` without a readable scheduler decides
        the end of the dense warm-up from this step's learning rate (``LrWarmupTracker``); the mode follows the
        optimizer's β1 (:meth:`MomentumMode.follow_beta`)."""
        tracker = self.warmup_tracker
        if tracker is not None and tracker.end is None:
            lr = optimizer_lr(self.engine) if hasattr(self.engine, "optimizer") else None
            skipped = int(getattr(self.engine, "skipped_steps", 0) or 0)
            if tracker.observe(int(self.engine.global_steps), lr, skipped) is not None:
                self._end_warmup(tracker.end, log=True)
        self.mode.follow_beta(self.engine)

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
