"""Adam's bias-corrected variance frozen after the dense warm-up (1-bit Adam's remedy, Tang et al., ICML 2021).

Error feedback keeps what was not sent and delivers it later, in a burst: an element that waits 100 steps
arrives with ~100 steps of gradient at once. SGD applies the sum linearly, so nothing is lost. Adam does
not: it divides the burst by ``sqrt(v)``, and ``v`` grows with the burst's square, so the element moves
about one learning rate once instead of a hundred times; exact top-k loses as much as DRAGONN (docs/results/convergence/lm_defaults_trials.md).
1-bit Adam makes Adam linear again by freezing the second moment after a dense warm-up: the update is then
momentum SGD with a fixed per-element preconditioner, and error feedback works as for SGD (DGC's momentum
correction solves the same problem for SGD momentum, Lin et al., ICLR 2018).

:class:`VarianceFreeze` registers a pre-step hook on the engine's innermost ``torch.optim.Optimizer`` (torch
Adam/AdamW: per-parameter ``exp_avg_sq`` and ``step``, bias correction ``1 − β2^t``). At the first step at
or after ``freeze_step`` in which a bucket was compressed it records the bias-corrected variance
``V̂ = v / (1 − β2^t)``. Before every later step it sets ``v ← (V̂·(1 − β2^(t+1)) − (1 − β2)·g²) / β2``, so
that Adam's own update ``β2·v + (1 − β2)·g²`` lands on ``V̂·(1 − β2^(t+1))`` and its bias-corrected
denominator is ``sqrt(V̂)`` whatever this step's gradient (the burst included) and however many steps pass.
A few vector passes over the variance per step. A skipped step (fp16 overflow) runs no optimizer step.
After a checkpoint load the next step records ``V̂`` again from the loaded state (the same value: the
variance is kept on target).

Variance refresh (momentum mode, ``variance_refresh_steps``; 0/1 Adam, Lu et al., ICLR 2022): a frozen
``V̂`` drifts from Adam's, up to ~10x per tensor over a 2000-step GPT run (``launch/variance_drift.py``). On a
refresh step the hooks reduce the raw gradient densely, so the optimizer receives ``ḡ`` (averaged, clipped
as Adam would see it); the pre-hook moves ``V̂ ← ρ·V̂ + (1 − ρ)·ḡ²`` (floored again) and zeroes the gradient
and ``exp_avg``, so Adam applies no update (AdamW still decays the weights once). That step's momentum was
added to the residual, unsent (``engine/base.py``): it goes out with later steps, nothing is lost.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional

import torch
from deepspeed.utils.logging import print_dist


def base_optimizer(engine: Any) -> Optional[torch.optim.Optimizer]:
    """The innermost ``torch.optim.Optimizer`` of a DeepSpeed engine (through BF16/FP16/ZeRO wrappers)."""
    opt, seen = getattr(engine, "optimizer", None), 0
    while opt is not None and seen < 8:
        inner = getattr(opt, "optimizer", None)
        if isinstance(opt, torch.optim.Optimizer) and not isinstance(inner, torch.optim.Optimizer):
            return opt
        opt, seen = inner, seen + 1
    return None


def adam_beta1(engine: Any) -> Optional[float]:
    """β1 of the engine's Adam-type optimizer (``betas[0]`` of its first parameter group), or None where the
    innermost optimizer has no ``betas`` (SGD, Adagrad, ...)."""
    opt = base_optimizer(engine)
    groups = getattr(opt, "param_groups", None) or []
    betas = groups[0].get("betas") if groups else None
    return float(betas[0]) if betas is not None else None


def optimizer_lr(engine: Any) -> Optional[float]:
    """The largest finite learning rate over the parameter groups of the engine's innermost optimizer (None:
    none; a group whose ``lr`` is None or not a number, e.g. Adafactor's relative steps, is skipped)."""
    opt = base_optimizer(engine)
    lrs = []
    for g in getattr(opt, "param_groups", None) or []:
        try:
            lr = float(g["lr"])
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(lr):
            lrs.append(lr)
    return max(lrs) if lrs else None


def _adam_classes() -> tuple:
    """The optimizers whose update the momentum mode can steer: torch's Adam and AdamW, DeepSpeed's FusedAdam
    and DeepSpeedCPUAdam (Adam's moments ``exp_avg``/``exp_avg_sq``, a per-parameter ``step``)."""
    classes = [torch.optim.Adam, torch.optim.AdamW]
    for module, name in (("deepspeed.ops.adam", "FusedAdam"), ("deepspeed.ops.adam", "DeepSpeedCPUAdam")):
        try:
            classes.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(classes)


def momentum_refusal(engine: Any) -> Optional[str]:
    """Why the momentum mode cannot serve this engine's optimizer (a sentence fragment naming it), or None.

    It needs Adam's update exactly (Adam, AdamW, DeepSpeed's FusedAdam/CPUAdam; not NAdam, RAdam, Adamax:
    they apply the moments differently), one β1 in (0, 1) for every parameter group (the local momentum's,
    and the first moment is set through it), β2 in (0, 1) (the frozen variance is set through it), no
    amsgrad, no ``maximize``, and weight decay that is decoupled (AdamW) or zero: coupled L2 decay would
    enter the first moment once per step, not accumulated as Adam does."""
    opt = base_optimizer(engine)
    name = type(opt if opt is not None else getattr(engine, "optimizer", None)).__name__
    groups = getattr(opt, "param_groups", None) or []
    if not isinstance(opt, _adam_classes()) or not groups or any(g.get("betas") is None for g in groups):
        return (f"needs Adam's update (Adam, AdamW, FusedAdam, DeepSpeedCPUAdam: 'betas' and Adam's moments); "
                f"this engine's optimizer is {name}")
    if not callable(getattr(opt, "register_step_pre_hook", None)):
        return f"needs the optimizer's register_step_pre_hook (torch.optim.Optimizer, torch >= 2.0); {name} has none"
    beta1s = {float(g["betas"][0]) for g in groups}
    if len(beta1s) > 1:
        return f"needs one betas[0] for every parameter group; this {name} has {sorted(beta1s)}"
    bad = [g["betas"] for g in groups if not (0.0 < float(g["betas"][0]) < 1.0 and 0.0 < float(g["betas"][1]) < 1.0)]
    if bad:
        return f"needs betas[0] and betas[1] in (0, 1); this {name} has betas={tuple(bad[0])}"
    if any(g.get("amsgrad") for g in groups):
        return f"does not support amsgrad ({name})"
    if any(g.get("maximize") for g in groups):
        return f"does not support maximize ({name})"
    decoupled = (isinstance(opt, torch.optim.AdamW) or bool(getattr(opt, "adam_w_mode", False))
                 or type(opt).__name__ in ("AdamW", "FusedAdamW"))
    coupled = [g["weight_decay"] for g in groups if g.get("weight_decay", 0.0) and not decoupled
               and not g.get("decoupled_weight_decay", False)]
    if coupled:
        return f"needs decoupled weight decay (AdamW); this {name} adds weight_decay={coupled[0]} to the gradient"
    return None


#: the least weight the frozen variance keeps at a refresh by default: one step's g² is a one-sample estimate,
#: so it gets at most 10 % (measured: the LM with β2 0.95, 500 steps, ends +2.7 % of dense with 0.5, +1.7 % with 0.9)
DEFAULT_DECAY_FLOOR = 0.9


def default_refresh_decay(beta2: float, refresh_steps: int) -> float:
    """The default ``ρ`` of a variance refresh: ``max(β2^refresh_steps, DEFAULT_DECAY_FLOOR)``."""
    return max(beta2 ** max(refresh_steps, 1), DEFAULT_DECAY_FLOOR)


def floor_variance_(v: torch.Tensor, floor: float) -> torch.Tensor:
    """``v`` (a bias-corrected variance, one parameter tensor) raised in place to ``(floor × mean sqrt(v))²``,
    where that is finite and > 0 (``variance_floor``); returns ``v``."""
    if floor > 0.0 and v.numel():
        low = (floor * float(v.sqrt().mean())) ** 2
        if math.isfinite(low) and low > 0.0:
            v.clamp_min_(low)
    return v


def _float_of(t: torch.Tensor) -> torch.dtype:
    """float32 for 16-bit tensors, the tensor's own dtype otherwise (a variance kept from a gradient)."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _step_count(state: dict) -> Optional[float]:
    step = state.get("step")
    if step is None:
        return None
    return float(step.item() if torch.is_tensor(step) else step)


class VarianceFreeze:
    """Freeze Adam's bias-corrected ``exp_avg_sq`` from the first optimizer step at or after global step
    ``freeze_step`` that follows a compressed reduction (:meth:`arm`).

    Args:
        engine: the DeepSpeed engine (``global_steps``: the steps taken before the current one).
        freeze_step: global step from which the variance may be frozen (the end of the dense warm-up).
        floor: each parameter tensor's frozen ``sqrt(V̂)`` is raised to at least ``floor`` × its mean
            ``sqrt(V̂)`` (0: none), so that an element quiet in the warm-up cannot take huge steps later.
        momentum: the gradients are already momenta (``compress: momentum``: the ranks' averaged local
            momenta ``β1·M + (1 − β1)·g``, tracked from the first step): before each frozen step ``exp_avg``
            is set to the gradient, so that Adam's first moment is that momentum and Adam applies
            ``lr · (g / (1 − β1^t)) / (sqrt(V̂) + eps)``, its own bias correction included (1-bit Adam).
        refresh: ``refresh(step)`` is True on a variance-refresh step (momentum mode; the gradient is then
            the dense raw gradient): ``V̂ ← ρ·V̂ + (1 − ρ)·g²`` and no update (module docstring).
        refresh_steps: the interval between refreshes (for the default ``ρ``).
        refresh_decay: ``ρ``; None: ``max(β2^refresh_steps, 0.9)`` of each parameter group's β2.
    """

    def __init__(self, engine: Any, freeze_step: int, floor: float = 0.0, momentum: bool = False,
                 refresh: Optional[Callable[[int], bool]] = None, refresh_steps: int = 0,
                 refresh_decay: Optional[float] = None):
        self.engine = engine
        self.freeze_step = int(freeze_step)
        self.floor = float(floor)
        self.momentum = bool(momentum)
        self.refresh = refresh if momentum and refresh is not None and refresh_steps >= 2 else None
        self.refresh_steps = int(refresh_steps)
        self.refresh_decay = refresh_decay
        self.refreshed = 0  # refreshes applied (this process)
        self.optimizer = base_optimizer(engine)
        self.frozen: Optional[List[torch.Tensor]] = None  # V̂ per entry of self.params
        self.params: List[torch.nn.Parameter] = []
        self.armed = False
        self.handle = None
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
            self.handle = self.optimizer.register_step_pre_hook(self._before_step)

    @property
    def active(self) -> bool:
        return self.handle is not None

    def arm(self) -> None:
        """A bucket was compressed this step: from now on the variance may be frozen."""
        self.armed = True

    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self.armed or int(self.engine.global_steps) < self.freeze_step:
            return
        if self.frozen is None and not self._record(optimizer):
            return
        late = 0
        refreshing = self.refresh is not None and self.refresh(int(self.engine.global_steps))
        for group in optimizer.param_groups:
            beta1, beta2 = float(group["betas"][0]), float(group["betas"][1])
            corrected = group.get("bias_correction", True)  # DeepSpeed's FusedAdam may turn it off
            for p in group["params"]:
                if p.grad is None:
                    continue
                i = self._index.get(id(p))
                state = optimizer.state.get(p, {})
                if i is None and refreshing:  # no variance frozen yet: this refresh's g² is the estimate
                    i = self._append(p, self._floored_(p.grad.detach().to(_float_of(p.grad)).square()))
                    late += 1
                    self._no_update(state, self.frozen[i], p.grad, beta2, corrected)
                    continue
                if i is None and self.refresh is None:  # started training after the freeze: its variance now
                    i = self._add(p, state, group)
                    late += i is not None
                if i is None:  # (with refreshes: Adam's own steps until the next refresh gives it a variance)
                    continue
                t = _step_count(state) + 1.0  # the step count Adam is about to use
                v, g = state["exp_avg_sq"], p.grad
                c2 = (1.0 - beta2 ** t) if corrected else 1.0
                if refreshing:
                    frozen = self.frozen[i]
                    rho = self.decay(beta2)
                    frozen.mul_(rho).addcmul_(g.to(frozen.dtype), g.to(frozen.dtype), value=1.0 - rho)
                    self._floored_(frozen)
                    self._no_update(state, frozen, g, beta2, corrected)
                    continue
                if self.momentum:
                    self._momentum_step(state, g, self.frozen[i], beta1, beta2, c2, float(group.get("eps", 1e-8)))
                    continue
                target = self.frozen[i] * (c2 / beta2)
                v.copy_(target.addcmul_(g, g, value=-(1.0 - beta2) / beta2))

        if refreshing:
            self.refreshed += 1
            if self.refreshed == 1:
                rho = sorted({self.decay(float(g["betas"][1])) for g in optimizer.param_groups})
                print_dist(f"DRAGONN: Adam's frozen variance refreshed from the dense gradient of step "
                           f"{int(self.engine.global_steps) + 1} (decay {', '.join(f'{r:.3g}' for r in rho)}; "
                           f"every {self.refresh_steps} steps, no update on those steps)", ranks=[0])
        if late:
            print_dist(f"DRAGONN: Adam's variance frozen at step {int(self.engine.global_steps) + 1} for {late} "
                       f"parameter tensor(s) that started training after the freeze", ranks=[0])

    def _frozen_of(self, state: dict, group: dict) -> Optional[torch.Tensor]:
        """``V̂ = v / (1 − β2^t)`` of one parameter, floored; None where Adam has no variance for it yet (or
        β2 is not in (0, 1): nothing to hold)."""
        betas, t = group.get("betas"), _step_count(state)
        if betas is None or "exp_avg_sq" not in state or not t or not 0.0 < float(betas[1]) < 1.0:
            return None
        corrected = group.get("bias_correction", True)
        v = state["exp_avg_sq"].detach() / ((1.0 - float(betas[1]) ** t) if corrected else 1.0)
        if v.numel() and not bool((v > 0).any()):  # no information (e.g. every warm-up step skipped): none
            return None
        return self._floored_(v)

    def _floored_(self, v: torch.Tensor) -> torch.Tensor:
        """``v`` raised in place to ``(floor × mean sqrt(v))²`` (its tensor's): :func:`floor_variance_`."""
        return floor_variance_(v, self.floor)

    def decay(self, beta2: float) -> float:
        """``ρ`` of a refresh for a parameter group with this β2 (``refresh_decay``, or the default rule)."""
        if self.refresh_decay is not None:
            return float(self.refresh_decay)
        return default_refresh_decay(beta2, self.refresh_steps)

    @staticmethod
    def _no_update(state: dict, frozen: torch.Tensor, g: torch.Tensor, beta2: float, corrected: bool) -> None:
        """A refresh step: the gradient and ``exp_avg`` zeroed, so that this step's update is exactly 0
        (``m_t = β1·0 + (1 − β1)·0``), and the variance set so that it lands on ``V̂·c2``. A parameter without
        Adam state yet gets it from Adam itself, zero (its first update is then 0 too)."""
        if "exp_avg_sq" in state and "exp_avg" in state:
            t = _step_count(state)
            c2 = (1.0 - beta2 ** (t + 1.0)) if corrected and t is not None else 1.0
            state["exp_avg_sq"].copy_(frozen).mul_(c2 / beta2)
            state["exp_avg"].zero_()
        g.zero_()

    def _append(self, p: torch.Tensor, frozen: torch.Tensor) -> int:
        self.params.append(p)
        self.frozen.append(frozen)
        self._index[id(p)] = len(self.params) - 1
        return self._index[id(p)]

    def _add(self, p: torch.Tensor, state: dict, group: dict) -> Optional[int]:
        """Freeze the variance of ``p`` now (index into ``frozen``), or None where there is none yet."""
        v = self._frozen_of(state, group)
        return None if v is None else self._append(p, v)

    @staticmethod
    def _momentum_step(state: dict, g: torch.Tensor, frozen: torch.Tensor, beta1: float, beta2: float, c2: float,
                       eps: float) -> None:
        """Set Adam's moments so that its update is ``lr · (g / c1) / (sqrt(V̂) + eps)``: ``g`` (the averaged
        momentum) divided by the frozen denominator. The variance lands on ``V̂·c2 + (1 − β2)·g²`` (never
        below ``V̂·c2``: no cancellation, no negative variance however large a burst), and the first moment
        on ``g`` times the ratio of that denominator to the frozen one."""
        v, m = state["exp_avg_sq"], state["exp_avg"]
        v.copy_(frozen).mul_(c2 / beta2)
        denom = frozen.mul(c2).addcmul_(g, g, value=1.0 - beta2).div_(c2).sqrt_().add_(eps)
        denom.div_(frozen.sqrt().add_(eps))  # Adam's denominator over the frozen one (>= 1)
        m.copy_(g).mul_(denom).sub_(g, alpha=1.0 - beta1).div_(beta1)

    def _record(self, optimizer) -> bool:
        """Record ``V̂ = v / (1 − β2^t)`` of every Adam-type parameter; False (and the hook removed) when there
        is none (an optimizer without ``exp_avg_sq`` and a per-parameter ``step``)."""
        params, frozen = [], []
        for group in optimizer.param_groups:
            for p in group["params"]:
                v = self._frozen_of(optimizer.state.get(p, {}), group)
                if v is not None:
                    params.append(p)
                    frozen.append(v)
        if not params:
            if self.refresh is not None:  # Adam has no variance yet (a warm start without optimizer state, a
                # warm-up whose steps were all skipped): each parameter gets one at the next refresh
                print_dist("DRAGONN: warning: Adam has no variance to freeze at step "
                           f"{int(self.engine.global_steps) + 1}; Adam's own steps until the next variance refresh "
                           f"(variance_refresh_steps={self.refresh_steps}) freezes one", ranks=[0])
                self.params, self.frozen, self._index = [], [], {}
                return True
            if (any("betas" not in g for g in optimizer.param_groups)
                    or (optimizer.state and not any("exp_avg_sq" in s for s in optimizer.state.values()))):
                self.handle.remove()  # not Adam's state: nothing to freeze, ever
                self.handle = None
            return False  # (no variance yet: record at a later step)
        self.params, self.frozen = params, frozen
        self._index = {id(p): i for i, p in enumerate(params)}
        what = "the sparse momentum applied as it is" if self.momentum else "1-bit Adam's remedy for error feedback"
        print_dist(f"DRAGONN: Adam's bias-corrected variance frozen from step {int(self.engine.global_steps) + 1} "
                   f"({sum(v.numel() for v in frozen)} elements, floor {self.floor:g} of each tensor's mean; "
                   f"{what})", ranks=[0])
        return True

    def reset(self) -> None:
        """Record ``V̂`` again at the next step (a checkpoint load replaced the optimizer state)."""
        self.frozen, self.params = None, []

    def state_dict(self) -> dict:
        """The frozen ``V̂`` (None before the freeze), in the optimizer's parameter order, and whether armed:
        saved with this rank's DRAGONN state, so that a resumed run divides by exactly the same values
        (recomputing them from ``exp_avg_sq`` would round differently)."""
        if self.frozen is None or self.optimizer is None:
            return {"armed": self.armed, "frozen": None}
        where = {id(p): (gi, pi) for gi, g in enumerate(self.optimizer.param_groups) for pi, p in enumerate(g["params"])}
        return {"armed": self.armed, "frozen": [v.detach().clone() for v in self.frozen],
                "positions": [where.get(id(p)) for p in self.params]}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Restore :meth:`state_dict` onto the optimizer's parameters (those with Adam's moments, in order);
        where they do not match (another model or partitioning) ``V̂`` is recorded again at the next step."""
        self.reset()
        if not state:
            return
        self.armed = bool(state.get("armed", False))
        frozen = state.get("frozen")
        if not frozen or self.optimizer is None:
            return
        groups = self.optimizer.param_groups
        positions = state.get("positions") or []
        try:
            params = [groups[gi]["params"][pi] for gi, pi in positions]
        except (IndexError, TypeError, ValueError, KeyError):
            return
        if len(params) != len(frozen) or any(v.shape != p.shape or "exp_avg_sq" not in self.optimizer.state.get(p, {})
                                             for v, p in zip(frozen, params)):
            return
        self.params = params
        self.frozen = [v.to(device=p.device, dtype=self.optimizer.state[p]["exp_avg_sq"].dtype, copy=True)
                       for v, p in zip(frozen, params)]  # a copy: refreshes change V̂ in place
        self._index = {id(p): i for i, p in enumerate(params)}
