"""Adam's bias-corrected variance frozen after the dense warm-up: the momentum mode's optimizer side (1-bit
Adam, Tang et al., ICML 2021; DeepSpeed <= 0.19.7 ``runtime/fp16/onebit/adam.py``).

Error feedback delivers what waited in a burst: an element that waits 100 steps arrives with ~100 steps of
momentum. Adam would divide the burst by ``sqrt(v)``, and ``v`` grows with the burst's square, so the element
would move about one learning rate once instead of a hundred times (docs/results/convergence/
lm_defaults_trials.md). With the variance frozen, Adam's update is momentum SGD with a fixed per-element
preconditioner, and delays stay linear.

:class:`VarianceFreeze` registers a pre-step hook on the engine's innermost ``torch.optim.Optimizer`` (torch
Adam/AdamW, DeepSpeed's FusedAdam/CPUAdam: per-parameter ``exp_avg``, ``exp_avg_sq``, ``step``). At the first
step at or after ``freeze_step`` in which a bucket sent the momentum (:meth:`arm`) it records each tensor's
``V̂ = v / (1 − β2^t)`` and which elements it knows (those with ``V̂ > 0``; floored, ``variance_math``). Before every later step it
sets Adam's moments of the known elements so that Adam applies ``lr · (g / c1) / (sqrt(V̂) + eps)``, ``g``
being the averaged momentum that arrived (``variance_math.momentum_step_``). At ZeRO-3 the tensors are the
fp32 sub-group flats (DeepSpeed 0.19.8 ``runtime/zero/stage3.py``: ``fp32_partitioned_groups_flat``), each
lent to its group for its own ``step()`` (one pre-hook call per sub-group): the same elementwise arithmetic.
Elements without gradient through the warm-up and tensors that first get gradient after the freeze keep
Adam's own update until a variance refresh gives them a variance.

Variance refresh (``variance_refresh_steps``; 0/1 Adam, Lu et al., ICLR 2022): a frozen ``V̂`` drifts from
Adam's, up to ~10x per tensor over a 2000-step run (``launch/variance_drift.py``). On a refresh step the hooks
reduce the raw gradient densely, the pre-hook moves ``V̂ ← ρ·V̂ + (1 − ρ)·ḡ²`` and zeroes the gradient and
``exp_avg``, so Adam applies no update (AdamW still decays the weights once). That step's momentum waits in
the residual (``engine/base.py``): nothing is lost.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from deepspeed.utils.logging import print_dist

from ..feedback import residual_dtype
from . import variance_math
from .adam import base_optimizer, optimizer_params
from .variance_math import (bias_correction2, default_refresh_decay, floor_variance_, known_mask,
                            momentum_step_, no_update_, refresh_)


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


def _own_vhat(state: dict, beta2: float, corrected: bool, t: Optional[float] = None) -> Optional[torch.Tensor]:
    """Adam's own bias-corrected variance of a parameter (None without Adam state); ``t``: its step count
    (None: ``state["step"]``)."""
    if "exp_avg_sq" not in state:
        return None
    t = _step_count(state) if t is None else t
    if not t:
        return None
    return state["exp_avg_sq"].detach() / bias_correction2(beta2, t, corrected)


class VarianceFreeze:
    """Freeze Adam's bias-corrected ``exp_avg_sq`` of the known elements (module docstring).

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
        # V̂ per entry of self.params (None: not frozen yet); exactly 0 where the element is not known (no
        # variance yet): the known mask is derived from it (``variance_math.known_mask``), not stored
        self.frozen: Optional[List[torch.Tensor]] = None
        self.params: List[torch.nn.Parameter] = []
        self._index: Dict[int, int] = {}
        # (any, all) of each known mask, read back once after it changes (not at every step)
        self._cover: Dict[int, Tuple[bool, bool]] = {}
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

    @property
    def known(self) -> List[torch.Tensor]:
        """Bool mask per entry: the elements V̂ is an estimate for (``V̂ > 0``; derived, a transient)."""
        return [known_mask(v) for v in self.frozen or []]

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
        if self.frozen is None:
            self._record(optimizer)
        refreshing = self.refresh is not None and self.refresh(step)
        new, joined = 0, 0
        for group in optimizer.param_groups:
            beta1, beta2 = float(group["betas"][0]), float(group["betas"][1])
            corrected = group.get("bias_correction", True)  # DeepSpeed's FusedAdam may turn it off
            shared = _group_steps(optimizer, group["params"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                i = self._index.get(id(p))
                if i is None:  # first gradient after the freeze: Adam's own update until a refresh
                    i, new = self._append(p, torch.zeros_like(p, dtype=residual_dtype(p.dtype))), new + 1
                state = optimizer.state.get(p, {})
                t = shared if shared is not None and "exp_avg_sq" in state else _step_count(state)
                if refreshing:
                    known = known_mask(self.frozen[i])
                    joined += refresh_(self.frozen[i], known, p.grad.detach(),
                                       _own_vhat(state, beta2, corrected, t), self.decay(beta2), self.fraction)
                    no_update_(state, self.frozen[i], known, p.grad, beta2, corrected, t)
                elif t is not None and "exp_avg_sq" in state and self._coverage(i)[0]:
                    every = self._coverage(i)[1]  # all known: no mask needed
                    momentum_step_(state, p.grad, self.frozen[i], None if every else known_mask(self.frozen[i]),
                                   beta1, beta2, bias_correction2(beta2, t + 1.0, corrected),
                                   float(group.get("eps", 1e-8)), all_known=every)
        if refreshing:  # refresh_ may have grown the known masks
            self._cover.clear()
        self._log(step, refreshing, new, joined)

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

    def _coverage(self, i: int) -> Tuple[bool, bool]:
        """(any, all) of entry ``i``'s known mask; one read-back, cached until the mask changes."""
        cover = self._cover.get(i)
        if cover is None:
            k = known_mask(self.frozen[i])
            cover = self._cover[i] = tuple(torch.stack([k.any(), k.all()]).tolist())
        return cover

    def _append(self, p: torch.Tensor, frozen: torch.Tensor) -> int:
        """Add ``p`` with its frozen ``V̂`` (0 where it has none: not known)."""
        self._cover.pop(len(self.params), None)
        self.params.append(p)
        self.frozen.append(frozen)
        self._index[id(p)] = len(self.params) - 1
        return self._index[id(p)]

    def _record(self, optimizer) -> None:
        """Record ``V̂ = v / (1 − β2^t)`` and its known elements for every parameter with Adam state (every
        sub-group's at ZeRO-3, whose groups hold one sub-group at a time: ``adam.optimizer_params``)."""
        self.params, self.frozen, self._index = [], [], {}
        self._cover.clear()
        for group, params in zip(optimizer.param_groups, optimizer_params(self.engine, optimizer)):
            beta2, corrected = float(group["betas"][1]), group.get("bias_correction", True)
            shared = _group_steps(optimizer, params)
            for p in params:
                vhat = (_own_vhat(optimizer.state.get(p, {}), beta2, corrected, shared) if 0.0 < beta2 < 1.0
                        else None)
                if vhat is None:
                    continue
                # the floor raises the known elements only: the others stay exactly 0 (not known)
                self._append(p, floor_variance_(vhat.clone(), self.fraction, known_mask(vhat)))
        total = sum(v.numel() for v in self.frozen)
        quiet = self.unknown()
        extra = (f"; {quiet} element(s) without gradient in the warm-up keep Adam's own update until a variance refresh"
                 if quiet else "")
        print_dist(f"DRAGONN: Adam's bias-corrected variance frozen from step {int(self.engine.global_steps) + 1} "
                   f"({total - quiet} of {total} elements; the sparse momentum applied as it is{extra})", ranks=[0])

    def reset(self) -> None:
        """Record ``V̂`` again at the next step (a checkpoint load replaced the optimizer state)."""
        self.frozen, self.params, self._index = None, [], {}
        self._cover.clear()

    def state_dict(self) -> dict:
        """The frozen ``V̂`` (None before the freeze; its zeros are the elements not known), in the optimizer's
        parameter order, and whether armed: saved with this rank's DRAGONN state, so that a resumed run divides by exactly the same
        values (recomputing them from ``exp_avg_sq`` would round differently)."""
        if self.frozen is None or self.optimizer is None:
            return {"armed": self.armed, "frozen": None}
        where = {id(p): (gi, pi) for gi, ps in enumerate(optimizer_params(self.engine, self.optimizer))
                 for pi, p in enumerate(ps)}
        return {"armed": self.armed, "frozen": [v.detach().clone() for v in self.frozen],
                "positions": [where.get(id(p)) for p in self.params]}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Restore :meth:`state_dict` onto the optimizer's parameters; where they do not match (another model
        or partitioning) ``V̂`` is recorded again at the next step."""
        self.reset()
        if not state:
            return
        self.armed = bool(state.get("armed", False))
        frozen = state.get("frozen")
        if frozen is None or self.optimizer is None:
            return
        groups = optimizer_params(self.engine, self.optimizer)
        try:
            params = [groups[gi][pi] for gi, pi in state.get("positions") or []]
        except (IndexError, TypeError, ValueError, KeyError):
            return
        if len(params) != len(frozen) or any(v.shape != p.shape for v, p in zip(frozen, params)):
            return
        self.frozen = []
        for p, v in zip(params, frozen):  # copies: refreshes change V̂ in place
            self._append(p, v.to(device=p.device, dtype=residual_dtype(p.dtype), copy=True))


__all__ = ["VarianceFreeze"]
