"""When a bucket is compressed, and at which density: the dense warm-up, then DGC's density warm-up.

Step ``t`` (DeepSpeed's ``global_steps``): dense while ``t < warmup_steps`` (as the DRAGONN paper's 200 warm-up
iterations); then for ``density_warmup_steps`` steps the density falls exponentially,
``d(j) = start · (density / start)^(j / W)`` (DGC, Lin et al., ICLR 2018, Sec. 3.3); then ``density``. Momentum
mode: every ``refresh_steps`` steps after the warm-up, one step is a variance refresh (:meth:`DensitySchedule.refresh`).
See docs/design.md, 'The data path of one bucket' (Schedule).
"""
from __future__ import annotations

import math
from typing import Optional, Union


#: ``warmup_steps`` of a schedule whose dense warm-up has no end yet (``"auto"`` following the learning rate,
#: engine/warmup.py): every step is dense until the end is set.
UNDECIDED = 1 << 62

#: ``"density_warmup_steps": "auto"`` is this many times the dense warm-up (300 after the LM/GPT's 100; the
#: measurements behind it are in docs/results.md) ...
AUTO_DENSITY_FACTOR = 3
#: ... and never shorter than this (the fixed default before ``"auto"``).
AUTO_DENSITY_MIN_STEPS = 100


def auto_density_warmup_steps(warmup_steps: int, density: float = 1.0) -> int:
    """``"density_warmup_steps": "auto"`` after a dense warm-up of ``warmup_steps`` steps (an int >= 0):
    ``max(100, 3 × warmup_steps, ⌈1 / density⌉)``. The last term is an element's wait for its turn at the final
    density: at 0.001 a 1000-step warm-up took the LM from +6.6 % to +1.4 % of dense (docs/results.md,
    "Density 0.001: the age bound"); at 0.01 and above it changes nothing."""
    return max(AUTO_DENSITY_MIN_STEPS, AUTO_DENSITY_FACTOR * int(warmup_steps), element_wait(density))


#: the longest wait :func:`element_wait` reports, and the longest ``"auto"`` age bound (``plan.resolve_defaults``):
#: a density of 1e-300 must not make a 300-digit step count
MAX_WAIT = 1 << 31


def element_wait(density: float) -> int:
    """``⌈1 / density⌉`` steps (at most :data:`MAX_WAIT`; 0 at density 1): an element's wait for its turn."""
    return math.ceil(min(1.0 / density - 1e-9, MAX_WAIT)) if 0.0 < density < 1.0 else 0


class DensitySchedule:
    """Density of each step (None: a dense warm-up step). Pure function of the step and the config."""

    def __init__(self, density: float, warmup_steps: int = 0, density_warmup_steps: Union[int, str] = 0,
                 density_warmup_start: float = 0.25, refresh_steps: int = 0):
        self.density = float(density)
        self.warmup_steps = int(warmup_steps)  # may be set later (UNDECIDED -> the step the hook decides)
        self.refresh_steps = int(refresh_steps) if refresh_steps >= 2 else 0
        self.start = float(density_warmup_start)
        self.auto_steps = density_warmup_steps == "auto"
        self._steps = 0 if self.auto_steps else int(density_warmup_steps)

    @property
    def steps(self) -> int:
        """Steps of the density warm-up (0: none, also where its start would not lower the density); "auto"
        follows ``warmup_steps`` (:func:`auto_density_warmup_steps`), also when the hook decides it later."""
        if self.start <= self.density:
            return 0
        if not self.auto_steps:
            return self._steps
        return auto_density_warmup_steps(0 if self.warmup_steps == UNDECIDED else self.warmup_steps, self.density)

    def dense(self, step: int) -> bool:
        """True in the dense warm-up."""
        return step < self.warmup_steps

    def refresh(self, step: int) -> bool:
        """True at the last step of every ``refresh_steps`` steps after the warm-up (momentum mode)."""
        r = self.refresh_steps
        return r > 0 and step >= self.warmup_steps and (step - self.warmup_steps) % r == r - 1

    def compressed_index(self, step: int) -> int:
        """The index of ``step`` among the steps after the dense warm-up that are not variance refreshes (0 at the
        first): the age bound's clock (``compress/age_bound.py``). Steps before the end of the warm-up give 0."""
        j = max(0, step - self.warmup_steps)
        return j - (j // self.refresh_steps if self.refresh_steps else 0)

    def ticks(self, step: int) -> bool:
        """Whether ``step`` uses up an index of the age bound's clock (:meth:`compressed_index`): a step after
        the dense warm-up that is not a variance refresh."""
        return step >= self.warmup_steps and not self.refresh(step)

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
        if self.auto_steps and self.warmup_steps == UNDECIDED and self.steps:
            parts.append(f"density {self.start:g} -> {self.density:.8g} over {AUTO_DENSITY_FACTOR} times the dense "
                         f"warm-up (at least {auto_density_warmup_steps(0, self.density)} steps, exponential)")
        elif self.steps:
            unit = "step" if self.steps == 1 else "steps"
            parts.append(f"density {self.start:g} -> {self.density:.8g} over {self.steps} {unit} (exponential)")
        parts.append(f"then density {self.density:.8g}")
        if self.refresh_steps:
            parts.append(f"Adam's variance refreshed every {self.refresh_steps} steps")
        return ", ".join(parts)
