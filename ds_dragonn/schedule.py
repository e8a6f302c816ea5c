"""When a bucket is compressed, and at which density: the dense warm-up, then DGC's density warm-up.

Step ``t`` (DeepSpeed's ``global_steps``, the same on every rank):

* ``t < warmup_steps``: dense (DeepSpeed's allreduce), as the DRAGONN paper's 200 warm-up iterations;
* then, for ``density_warmup_steps`` steps (global steps, whether a bucket was compressed in them or not), the
  density falls exponentially from
  ``density_warmup_start`` to ``density``: ``d(j) = start · (density / start)^(j / W)`` at step
  ``warmup_steps + j`` (DGC, Lin et al., ICLR 2018, Sec. 3.3: 25 %, 6.25 %, 1.5625 %, ... per epoch);
* then ``density``.

Momentum mode (``compress: momentum``): every ``refresh_steps`` steps after the warm-up, one step is a
variance refresh (:meth:`DensitySchedule.refresh`: a dense reduction of the raw gradient, ``engine/adam.py``).

The error-feedback residual is what makes a sudden drop in density harmful early in training (it holds
many steps of small gradients at once); the warm-up keeps it small while the weights move fastest.
"""
from __future__ import annotations

from typing import Optional


#: ``warmup_steps`` of a schedule whose dense warm-up has no end yet (``"auto"`` following the learning rate,
#: engine/warmup.py): every step is dense until the end is set.
UNDECIDED = 1 << 62


class DensitySchedule:
    """Density of each step (None: a dense warm-up step). Pure function of the step and the config."""

    def __init__(self, density: float, warmup_steps: int = 0, density_warmup_steps: int = 0,
                 density_warmup_start: float = 0.25, refresh_steps: int = 0):
        self.density = float(density)
        self.warmup_steps = int(warmup_steps)
        self.refresh_steps = int(refresh_steps) if refresh_steps >= 2 else 0
        self.start = float(density_warmup_start)
        # no warm-up when it would not lower the density
        self.steps = int(density_warmup_steps) if self.start > self.density else 0

    @classmethod
    def from_config(cls, cfg) -> "DensitySchedule":
        refresh = cfg.variance_refresh_steps if cfg.compress.value == "momentum" else 0
        warmup = UNDECIDED if cfg.warmup_steps == "auto" else cfg.warmup_steps  # the hook's tracker decides
        return cls(cfg.density, warmup, cfg.density_warmup_steps, cfg.density_warmup_start, refresh)

    def dense(self, step: int) -> bool:
        """True in the dense warm-up."""
        return step < self.warmup_steps

    def refresh(self, step: int) -> bool:
        """True at the last step of every ``refresh_steps`` steps after the warm-up (momentum mode)."""
        r = self.refresh_steps
        return r > 0 and step >= self.warmup_steps and (step - self.warmup_steps) % r == r - 1

    def warming(self, step: int) -> bool:
        """True while the density is above its target (compressed steps of the density warm-up)."""
        return self.warmup_steps <= step < self.warmup_steps + self.steps

    def at(self, step: int) -> Optional[float]:
        """The density of ``step`` (None in the dense warm-up)."""
        if self.dense(step):
            return None
        j = step - self.warmup_steps
        if j >= self.steps:
            return self.density
        return self.start * (self.density / self.start) ** (j / self.steps)

    def describe(self) -> str:
        parts = [f"{self.warmup_steps} dense warm-up steps" if self.warmup_steps != UNDECIDED else
                 "dense warm-up steps until twice the step at which the learning rate stops rising (at least 30)"]
        if self.steps:
            parts.append(f"density {self.start:g} -> {self.density:g} over {self.steps} steps (exponential)")
        parts.append(f"then density {self.density:g}")
        if self.refresh_steps:
            parts.append(f"Adam's variance refreshed every {self.refresh_steps} steps")
        return ", ".join(parts)
