"""``"warmup_steps": "auto"``: the dense warm-up ends after the learning-rate warm-up.

The momentum mode freezes Adam's variance at the end of the dense warm-up, and from then on an element waits
~1/density steps for its turn. Both cost most while the loss falls fastest, inside and just after the
learning-rate warm-up. On the 1.85 M GPT at a tuned learning rate (2e-3, a 50-step warm-up) a 100-step dense
warm-up instead of 30 cut the final gap to dense from +9.1 % to +3.7 % (docs/results.md, "At a better-tuned
learning rate"). So ``auto`` is ``max(AUTO_MIN_STEPS, AUTO_FACTOR * w)``, where ``w`` is the
engine's learning-rate warm-up, read from:

* DeepSpeed's ``WarmupLR`` / ``WarmupDecayLR`` / ``WarmupCosineLR`` (``warmup_num_steps``,
  deepspeed/runtime/lr_schedules.py);
* a ``torch.optim.lr_scheduler.LambdaLR`` (Hugging Face's ``get_*_schedule_with_warmup``): the steps its
  multiplier rises before it first stops rising;
* no scheduler: ``w = 0`` (a constant learning rate).

Any other scheduler: ``AUTO_MIN_STEPS``, with a warning naming it (set ``warmup_steps`` to a number).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..config import DragonnConfig

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
    if isinstance(lambdas, (list, tuple)) and lambdas and all(callable(f) for f in lambdas):
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


def resolve_warmup_steps(cfg: DragonnConfig, engine: Any) -> DragonnConfig:
    """``cfg`` with ``warmup_steps: "auto"`` replaced by a number of steps for ``engine`` (module docstring);
    ``cfg`` itself where it is already a number. Logs the choice on rank 0."""
    if cfg.warmup_steps != "auto":
        return cfg
    from deepspeed.utils.logging import print_dist

    scheduler = getattr(engine, "lr_scheduler", None)
    lr_warmup = lr_warmup_steps(scheduler)
    if lr_warmup is None:
        steps = AUTO_MIN_STEPS
        print_dist(f"DRAGONN: warning: 'warmup_steps': 'auto' cannot read the learning-rate warm-up of "
                   f"{type(scheduler).__name__}; using {steps} dense warm-up steps. Set 'dragonn.warmup_steps' to "
                   f"about twice its warm-up steps", ranks=[0])
    else:
        steps = max(AUTO_MIN_STEPS, AUTO_FACTOR * lr_warmup)
        print_dist(f"DRAGONN: warmup_steps 'auto' -> {steps} dense warm-up steps (the learning-rate warm-up: "
                   f"{lr_warmup} steps)", ranks=[0])
    return cfg.model_copy(update={"warmup_steps": steps})
