"""``"warmup_steps": "auto"``: the dense warm-up ends after the learning-rate warm-up.

``auto`` is ``max(AUTO_MIN_STEPS, AUTO_FACTOR * w)``, ``w`` the engine's learning-rate warm-up, read from DeepSpeed's
``WarmupLR`` / ``WarmupDecayLR`` / ``WarmupCosineLR`` (``warmup_num_steps``, deepspeed/runtime/lr_schedules.py) or a
``torch.optim.lr_scheduler.LambdaLR`` (the steps its multiplier first rises). Without a readable scheduler the hook
follows the optimizer's learning rate step by step (:class:`LrWarmupTracker`, the same first-non-rise rule). Local
steps read the scheduler only (else ``AUTO_MIN_STEPS``, with a warning). See docs/design.md, 'The data path of one
bucket' (Schedule).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..config import DragonnConfig
from .state import saved_count

#: ``auto`` is never shorter than this (the momentum mode's variance needs some dense steps to estimate).
AUTO_MIN_STEPS = 30
#: ``auto`` = this many times the learning-rate warm-up (the measured better choice: 100 after a 50-step one).
AUTO_FACTOR = 2
#: A LambdaLR multiplier still rising after this many steps is not read as a warm-up (e.g. a range test).
PROBE_LIMIT = 100_000


def lr_warmup_steps(scheduler: Any) -> Optional[int]:
    """Optimizer steps of ``scheduler``'s learning-rate warm-up (its rise to the peak): 0 for None, None where
    the scheduler's type is not one this module reads or its rise does not end within ``PROBE_LIMIT`` steps."""
    if scheduler is None:
        return 0
    steps = getattr(scheduler, "warmup_num_steps", None)  # DeepSpeed's Warmup* schedules
    if isinstance(steps, int) and not isinstance(steps, bool):
        return max(0, steps)
    lambdas = getattr(scheduler, "lr_lambdas", None)  # torch's LambdaLR (Hugging Face's schedules)
    if (isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and isinstance(lambdas, (list, tuple)) and lambdas
            and all(callable(f) for f in lambdas)):  # (MultiplicativeLR's lambdas are step-to-step factors)
        rises = [_rise(f) for f in lambdas]
        return None if any(r is None for r in rises) else max(rises)
    return None


def _rise(multiplier: Callable[[int], float]) -> Optional[int]:
    """The first step ``t`` with ``f(t + 1) <= f(t)``: the number of steps ``f`` rises (None: still rising at
    ``PROBE_LIMIT``, or ``f`` raised)."""
    try:
        prev = float(multiplier(0))
        for t in range(PROBE_LIMIT):
            cur = float(multiplier(t + 1))
            if not cur > prev:
                return t
            prev = cur
    except Exception:  # a user's multiplier may be undefined past its schedule: not readable
        return None
    return None


def resolve_warmup_steps(cfg: DragonnConfig, engine: Any, follow: bool = True) -> DragonnConfig:
    """``cfg`` with ``warmup_steps: "auto"`` replaced by a number of steps for ``engine`` (module docstring);
    ``cfg`` itself where it is already a number. Where the engine's scheduler cannot be read, ``cfg`` keeps
    ``"auto"`` when ``follow`` (the hook then follows the learning rate: :class:`LrWarmupTracker`), else gets
    ``AUTO_MIN_STEPS``. Logs the choice on rank 0."""
    if cfg.warmup_steps != "auto":
        return cfg
    from deepspeed.utils.logging import print_dist

    scheduler = getattr(engine, "lr_scheduler", None)
    lr_warmup = lr_warmup_steps(scheduler)  # 0 without a scheduler
    what = "no scheduler in the engine" if scheduler is None else f"a {type(scheduler).__name__}"
    if follow and (scheduler is None or lr_warmup is None):
        print_dist(f"DRAGONN: warmup_steps 'auto': {what}, so the dense warm-up follows the optimizer's learning "
                   f"rate: it ends at twice the last step at which the learning rate rose (before it first stopped "
                   f"rising), at least {AUTO_MIN_STEPS} steps", ranks=[0])
        return cfg
    if lr_warmup is None:  # a scheduler this module cannot read (no scheduler: no learning-rate warm-up)
        steps = AUTO_MIN_STEPS
        print_dist(f"DRAGONN: warning: 'warmup_steps': 'auto' cannot read a learning-rate warm-up ({what}); using "
                   f"{steps} dense warm-up steps. If the learning rate warms up, set 'dragonn.warmup_steps' to about "
                   f"twice its warm-up steps", ranks=[0])
    else:
        steps = max(AUTO_MIN_STEPS, AUTO_FACTOR * lr_warmup)
        print_dist(f"DRAGONN: warmup_steps 'auto' -> {steps} dense warm-up steps (the learning-rate warm-up: "
                   f"{lr_warmup} steps)", ranks=[0])
    return cfg.model_copy(update={"warmup_steps": steps})


class LrWarmupTracker:
    """``"warmup_steps": "auto"`` where the scheduler cannot be read: decides the end of the dense warm-up
    online from the learning rate of each step (module docstring). Every rank sees the same learning rates,
    so every rank decides the same step.

    Attributes:
        end: the first compressed step (int), or None while undecided.
    """

    def __init__(self) -> None:
        self.end: Optional[int] = None
        self.last_rise = 0
        self.peaked = False  # the learning rate has stopped rising (from step 2 on: a flat start is not a peak)
        self.prev_lr: Optional[float] = None
        self.last_step: Optional[int] = None
        self.skipped = 0  # DeepSpeed's skipped_steps at the last observation

    def observe(self, step: int, lr: Optional[float], skipped: int = 0) -> Optional[int]:
        """Record ``lr`` (None: unknown) of optimizer step ``step`` (``engine.global_steps`` at its first
        reduction; later reductions of the same step are ignored); returns :attr:`end` (None: still dense).
        ``skipped``: DeepSpeed's count of steps skipped on overflow; DeepSpeed does not step the scheduler on one
        (0.19.8 ``runtime/engine.py`` ``_take_model_step``), so that step is not read as a peak."""
        if self.end is not None or step == self.last_step:
            return self.end
        self.last_step = step
        after_skip, self.skipped = skipped > self.skipped, max(self.skipped, int(skipped))
        if not self.peaked and not after_skip:
            if lr is not None and self.prev_lr is not None and lr > self.prev_lr:
                self.last_rise = step
            elif step >= 2:
                self.peaked = True
            if lr is not None:
                self.prev_lr = lr
        if self.peaked and step >= max(AUTO_MIN_STEPS, AUTO_FACTOR * self.last_rise):
            self.end = step
        return self.end

    def state_dict(self) -> dict:
        return {"end": self.end, "last_rise": self.last_rise, "peaked": self.peaked, "prev_lr": self.prev_lr,
                "last_step": self.last_step, "skipped": self.skipped}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Restore :meth:`state_dict` (None or malformed: start afresh; a state saved without the tracker)."""
        self.__init__()
        if not isinstance(state, dict):
            return
        end, rise, lr, last = (state.get(k) for k in ("end", "last_rise", "prev_lr", "last_step"))
        self.end = saved_count(end, None)
        self.last_rise = saved_count(rise)
        self.prev_lr = float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None
        self.last_step = last if isinstance(last, int) and not isinstance(last, bool) else None
        self.skipped = saved_count(state.get("skipped"))
        self.peaked = state.get("peaked") is True or self.end is not None
