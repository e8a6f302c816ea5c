"""Adam's bias-corrected variance frozen after the dense warm-up: the momentum mode's optimizer side (1-bit
Adam, Tang et al., ICML 2021; DeepSpeed <= 0.19.7 ``runtime/fp16/onebit/adam.py``).

:class:`VarianceFreeze` registers a pre-step hook on the engine's innermost ``torch.optim.Optimizer`` (torch
Adam/AdamW, DeepSpeed's FusedAdam/CPUAdam). At the first step at or after ``freeze_step`` in which a bucket sent
the momentum (:meth:`arm`) it records each tensor's ``V̂`` into Adam's own ``exp_avg_sq``; before every later
step it applies the known elements' update itself (``variance_math``). At ZeRO-3 the tensors are the fp32
sub-group flats (DeepSpeed 0.19.8 ``runtime/zero/stage3.py``: ``fp32_partitioned_groups_flat``). Variance
refresh: 0/1 Adam, Lu et al., ICLR 2022. See docs/design.md, 'The data path of one bucket' (What is compressed).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from deepspeed.utils.logging import print_dist

from . import variance_math
from .adam import base_optimizer, decoupled, optimizer_params
from .variance_math import (bias_correction2, default_refresh_decay, known_mask, momentum_step_, record_,
                            refresh_)


def _step_count(state: dict) -> Optional[float]:
    step = state.get("step")
    if step is None:
        return None
    return float(step.item() if torch.is_tensor(step) else step)


def _group_steps(optimizer: Any, params) -> Optional[float]:
    """The step count DeepSpeed's ``FusedAdam`` applies to every parameter of a group, or None for an optimizer
    that counts per parameter (``torch.optim.Adam``/``AdamW``). FusedAdam increments ``state["step"]`` of the last
    parameter of each dtype list only and passes that count to its kernel for the whole list
    (deepspeed/ops/adam/fused_adam.py); the other parameters' counts stay where they started."""
    if type(optimizer).__name__ != "FusedAdam":
        return None
    counts = [_step_count(optimizer.state.get(p, {})) for p in params]
    return max((c for c in counts if c is not None), default=None)


class VarianceFreeze:
    """Freeze Adam's bias-corrected variance of the known elements, in Adam's own ``exp_avg_sq`` (module docstring).

    Args:
        engine: the DeepSpeed engine (``global_steps``: the steps taken before the current one).
        freeze_step: global step from which the variance may be frozen (the end of the dense warm-up).
        refresh: ``refresh(step)`` is True on a variance-refresh step (the gradient is then the dense raw
            gradient): ``V̂ ← ρ·V̂ + (1 − ρ)·ḡ²``, unknown elements may join, and no update.
        refresh_steps: the interval between refreshes (for ``ρ = max(β2^refresh_steps, 0.9)``); below 2: none.
        fraction: each tensor's frozen ``sqrt(V̂)`` is floored at this fraction of its known elements' mean
            (None: ``variance_math.VARIANCE_FLOOR``).
    """

    def __init__(self, engine: Any, freeze_step: int, refresh: Optional[Callable[[int], bool]] = None,
                 refresh_steps: int = 0, fraction: Optional[float] = None):
        self.engine = engine
        self.freeze_step = int(freeze_step)
        self.fraction = float(variance_math.VARIANCE_FLOOR if fraction is None else fraction)
        self.refresh = refresh if refresh is not None and refresh_steps >= 2 else None
        self.refresh_steps = int(refresh_steps)
        self.refreshed = 0  # refreshes applied (this process)
        self._refreshed_at: Optional[int] = None  # the step of the last refresh (ZeRO-3 calls the hook per sub-group)
        self.optimizer = base_optimizer(engine)
        self.recorded = False  # V̂ was recorded into exp_avg_sq (the freeze began)
        self.params: List[torch.Tensor] = []  # the tensors with Adam state at the freeze, then those that got gradient
        self._index: Dict[int, int] = {}
        self._cover: Dict[int, Tuple[bool, bool]] = {}  # id(p) -> (any, all) known: read back once, until a refresh
        self.armed = False
        self.handle = None
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
            if all("betas" in g for g in self.optimizer.param_groups):
                self.handle = self.optimizer.register_step_pre_hook(self._before_step)

    @property
    def active(self) -> bool:
        return self.handle is not None

    def arm(self) -> None:
        """A bucket sent the momentum this step: from now on the variance may be frozen."""
        self.armed = True

    def _state(self, p: torch.Tensor) -> dict:
        return self.optimizer.state.get(p, {}) if self.optimizer is not None else {}

    def _known(self, p: torch.Tensor) -> torch.Tensor:
        state = self._state(p)
        if "exp_avg" not in state or "exp_avg_sq" not in state:
            return torch.zeros_like(p, dtype=torch.bool)
        return known_mask(state)

    @property
    def frozen(self) -> Optional[List[torch.Tensor]]:
        """``V̂`` per entry of ``params``, 0 where not known (None before the freeze): transient copies read from
        ``exp_avg_sq``, where it lives."""
        if not self.recorded:
            return None
        return [torch.where(k, self._state(p)["exp_avg_sq"], 0.0) if k.any() else torch.zeros_like(p)
                for p, k in zip(self.params, self.known)]

    @property
    def known(self) -> List[torch.Tensor]:
        """Bool mask per entry of ``params``: the elements V̂ is frozen for (``variance_math.known_mask``)."""
        return [self._known(p) for p in self.params]

    def unknown(self) -> int:
        """Elements that keep Adam's own update (no frozen variance yet)."""
        return sum(int((~k).sum()) for k in self.known)

    def decay(self, beta2: float) -> float:
        """``ρ`` of a refresh for a parameter group with this β2."""
        return default_refresh_decay(beta2, self.refresh_steps)

    def _before_step(self, optimizer, args, kwargs) -> None:
        step = int(self.engine.global_steps)
        if not self.armed or step < self.freeze_step:
            return
        if not self.recorded:
            self._record(optimizer)
        refreshing = self.refresh is not None and self.refresh(step)
        new, joined = 0, 0
        for group in optimizer.param_groups:
            beta1, beta2 = float(group["betas"][0]), float(group["betas"][1])
            corrected = group.get("bias_correction", True)  # DeepSpeed's FusedAdam may turn it off
            lr, eps = float(group["lr"]), float(group.get("eps", 1e-8))
            decay = 1.0 - lr * float(group.get("weight_decay", 0.0)) if decoupled(optimizer, group) else 1.0
            shared = _group_steps(optimizer, group["params"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if id(p) not in self._index:  # first gradient after the freeze: Adam's own update until a refresh
                    self._append(p)
                    new += 1
                state = optimizer.state.get(p, {})
                t = shared if shared is not None and "exp_avg_sq" in state else _step_count(state)
                if t is None or "exp_avg_sq" not in state or "exp_avg" not in state:
                    if refreshing:  # no update on a refresh step: Adam creates zero state, its first update 0
                        p.grad.zero_()
                    continue  # no Adam state yet: Adam creates it in this step, its own update
                if refreshing:
                    joined += refresh_(state, p.grad, beta2, bias_correction2(beta2, t, corrected),
                                       self.decay(beta2), self.fraction)
                    self._cover.pop(id(p), None)
                    continue
                some, every = self._coverage(p, state)
                if some:
                    momentum_step_(p, state, p.grad, every, beta2, 1.0 - beta1 ** (t + 1.0) if corrected else 1.0,
                                   lr, eps, decay)
        self._log(step, refreshing, new, joined)

    def _coverage(self, p: torch.Tensor, state: dict) -> Tuple[bool, bool]:
        """(any, all) of ``p``'s known mask: one read-back, cached until a refresh (the mask changes only there)."""
        cover = self._cover.get(id(p))
        if cover is None:
            k = known_mask(state)
            cover = self._cover[id(p)] = tuple(torch.stack([k.any(), k.all()]).tolist())
        return cover

    def _log(self, step: int, refreshing: bool, new: int, joined: int) -> None:
        if refreshing and step != self._refreshed_at:
            self.refreshed, self._refreshed_at = self.refreshed + 1, step
            if self.refreshed == 1:
                rho = sorted({self.decay(float(g["betas"][1])) for g in self.optimizer.param_groups})
                print_dist(f"DRAGONN: Adam's frozen variance refreshed from the dense gradient of step {step + 1} "
                           f"(decay {', '.join(f'{r:.3g}' for r in rho)}; every {self.refresh_steps} steps, no "
                           f"update on those steps)", ranks=[0])
        if new:
            then = "until a variance refresh gives them one" if self.refresh is not None else "(no variance refresh)"
            print_dist(f"DRAGONN: {new} parameter tensor(s) first got gradient at step {step + 1}, after the dense "
                       f"warm-up: Adam's own update on them {then}", ranks=[0])
        if joined:
            print_dist(f"DRAGONN: Adam's variance frozen at step {step + 1} for {joined} element(s) that started "
                       f"training after the freeze ({self.unknown()} still on Adam's own update)", ranks=[0])

    def _append(self, p: torch.Tensor) -> None:
        self._index[id(p)] = len(self.params)
        self.params.append(p)

    def _record(self, optimizer) -> None:
        """Record ``V̂ = v / (1 − β2^t)`` (floored) into ``exp_avg_sq`` and zero ``exp_avg`` at the elements with a
        variance, for every parameter with Adam state (every sub-group's at ZeRO-3). Elements that hold a frozen
        ``V̂`` already (``known_mask``) keep it."""
        self.params, self._index = [], {}
        self._cover.clear()
        total = quiet = 0
        for group, params in zip(optimizer.param_groups, optimizer_params(self.engine, optimizer)):
            beta2, corrected = float(group["betas"][1]), group.get("bias_correction", True)
            shared = _group_steps(optimizer, params)
            for p in params:
                state = optimizer.state.get(p, {})
                t = shared if shared is not None and "exp_avg_sq" in state else _step_count(state)
                if not t or "exp_avg_sq" not in state or "exp_avg" not in state or not 0.0 < beta2 < 1.0:
                    continue
                quiet_here = record_(state, bias_correction2(beta2, t, corrected), self.fraction)
                self._append(p)
                total, quiet = total + p.numel(), quiet + quiet_here
        self.recorded = True
        extra = (f"; {quiet} element(s) without gradient in the warm-up keep Adam's own update until a variance refresh"
                 if quiet else "")
        print_dist(f"DRAGONN: Adam's bias-corrected variance frozen from step {int(self.engine.global_steps) + 1} "
                   f"({total - quiet} of {total} elements, in Adam's own exp_avg_sq; the sparse momentum applied as "
                   f"it is{extra})", ranks=[0])

    def reset(self) -> None:
        """Record ``V̂`` again at the next step (a checkpoint load replaced the optimizer state)."""
        self.recorded, self.params, self._index = False, [], {}
        self._cover.clear()

    def state_dict(self) -> dict:
        """Whether armed and whether the freeze began: ``V̂`` itself is in the optimizer's state, which DeepSpeed
        saves, so a resumed run divides by exactly the same values."""
        return {"armed": self.armed, "recorded": self.recorded}

    def load_state_dict(self, state: Optional[dict], device: Any = None) -> None:
        """Restore :meth:`state_dict` (the optimizer's state holds ``V̂``; ``device``: unused, it holds no tensor);
        without one, ``V̂`` is recorded again at the next step."""
        self.reset()
        if not state:
            return
        self.armed = bool(state.get("armed", False))
        if state.get("recorded") and self.optimizer is not None:
            self.recorded = True
            for group, params in zip(self.optimizer.param_groups, optimizer_params(self.engine, self.optimizer)):
                for p in params:
                    if "exp_avg_sq" in self.optimizer.state.get(p, {}):
                        self._append(p)


__all__ = ["VarianceFreeze"]
