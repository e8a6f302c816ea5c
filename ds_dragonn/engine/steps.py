"""Residuals that follow the steps DeepSpeed actually applies: skipped (overflow) steps and the fp16 loss scale.

DeepSpeed checks the reduced gradients for Inf/NaN only after every bucket is reduced, and then skips the step.
:class:`StepGuard` ends each step when the engine has moved on and tells every store whether it was applied (exact
or O(k): ``plan.step_transaction``). When the fp16 loss scale S changes, the residuals are multiplied by
S_new / S_old before the next compensation. See docs/design.md, 'Around the step'.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from deepspeed.utils.logging import print_dist


def may_skip_steps(engine: Any) -> bool:
    """Whether DeepSpeed 0.19.8 may skip a step of this engine on overflow (``engine.skipped_steps`` grows):
    fp16 (the loss scaler); bf16 at ZeRO 0 (``BF16_Optimizer``, or the fp16 wrapper in bf16, skip a step whose
    gradient is not finite whatever ``check_grad_overflow`` says: ``runtime/bf16_optimizer.py``,
    ``runtime/fp16/fused_optimizer.py``); ZeRO 3 in any dtype (its ``step`` skips on a non-finite norm); ZeRO 1/2
    with bf16 and ``bf16.check_grad_overflow``, or in fp32 with ``zero_optimization.compute_grad_norm``
    (``runtime/zero/stage_1_and_2.py`` ``step``). Plain fp32 at ZeRO 0 never skips."""
    if getattr(engine, "fp16_enabled", lambda: False)():
        return True
    if type(getattr(engine, "optimizer", None)).__name__ == "BF16_Optimizer":
        return True
    bf16 = bool(getattr(engine, "bfloat16_enabled", lambda: False)())
    stage = getattr(engine, "zero_optimization_stage", lambda: 0)()
    return _SKIPS.get(stage, lambda engine, bf16: bf16)(engine, bf16)  # ZeRO 0: bf16 skips, fp32 never


def _skips_zero12(engine: Any, bf16: bool) -> bool:
    """ZeRO 1/2: bf16 with ``bf16.check_grad_overflow``, fp32 with ``zero_optimization.compute_grad_norm``."""
    if bf16:
        return bool(getattr(getattr(engine._config, "bfloat16_config", None), "check_grad_overflow", True))
    return bool(getattr(getattr(engine._config, "zero_config", None), "compute_grad_norm", True))


#: whether a ZeRO stage's optimizer may skip a step (fp16 and ``BF16_Optimizer`` aside): (engine, bf16) -> bool
_SKIPS = {1: _skips_zero12, 2: _skips_zero12, 3: lambda engine, bf16: True}


def step_transaction(engine: Any, exact: Optional[bool]) -> bool:
    """Whether this engine's skipped steps must leave no trace (``plan.step_transaction``: working copies of the
    residuals and momenta; else the O(k) log of what a step sent, ``ErrorFeedback(undo_sent=True)``)."""
    from ..plan import step_transaction as rule
    return rule(exact, may_skip_steps(engine), getattr(engine, "fp16_enabled", lambda: False)())[0]


def loss_scale(engine: Any) -> float:
    """The optimizer's current dynamic loss scale (``optimizer.loss_scale`` of DeepSpeed's fp16 and ZeRO
    optimizers), or 1.0 where there is none."""
    value = getattr(getattr(engine, "optimizer", None), "loss_scale", None)
    return float(value) if isinstance(value, (int, float)) and value > 0 else 1.0


class StepGuard:
    """Ends each step's residual transaction when the engine has moved on, and follows the loss scale.

    Args:
        stores: returns the objects holding residuals (``ErrorFeedback`` and exchanges): each has
            ``end_step(applied: bool)`` and ``rescale_(factor: float)``.
        skipped_steps: returns DeepSpeed's count of skipped steps (``engine.skipped_steps``).
        scale: returns the current loss scale (:func:`loss_scale`).
        ticks: whether a step uses up an index of the age bound's clock (``DensitySchedule.ticks``); a skipped
            one is counted in ``skipped_ticks``, so the next step sends the block the skipped one did not.
    """

    def __init__(self, stores: Callable[[], Iterable[Any]], skipped_steps: Callable[[], int],
                 scale: Callable[[], float], ticks: Callable[[int], bool] = lambda step: False):
        self._stores, self._skipped, self._scale, self._ticks = stores, skipped_steps, scale, ticks
        self._step: Optional[int] = None  # the global step whose transaction is open
        self._skipped_at_open = 0
        self.units: Optional[float] = None  # the loss scale the residuals are in (None: not known yet)
        self.restored_steps = 0  # skipped steps whose residual changes were discarded
        self.skipped_ticks = 0  # skipped steps that had used up an index of the age clock (checkpointed)
        self.exact = True  # the stores undo a skipped step exactly (else: ErrorFeedback's O(k) log; for the log line)

    def begin(self, step: int) -> None:
        """Call before every reduction of global step ``step``: ends the previous step's transaction if the
        engine moved on, rescales the residuals if the loss scale changed, opens this step's."""
        if self._step is not None and step != self._step:
            self.end()
        scale = self._scale()
        if self.units is not None and scale != self.units:
            for store in self._stores():
                store.rescale_(scale / self.units)
            print_dist(f"DRAGONN: loss scale {self.units:g} -> {scale:g}: residuals rescaled by "
                       f"{scale / self.units:g}", ranks=[0])
        self.units = scale
        if self._step is None:
            self._step, self._skipped_at_open = step, int(self._skipped())

    def end(self) -> None:
        """End the open transaction (no-op when none): applied unless DeepSpeed counted a skipped step."""
        if self._step is None:
            return
        applied = int(self._skipped()) == self._skipped_at_open
        for store in self._stores():
            store.end_step(applied)
        if not applied:
            self.restored_steps += 1
            self.skipped_ticks += int(bool(self._ticks(self._step)))
            what = ("residuals restored to their state before it" if self.exact else
                    "what it sent returned to the residuals; its finite gradient stays in them, its non-finite "
                    "entries were dropped (advanced.exact_skipped_steps)")
            print_dist(f"DRAGONN: step {self._step + 1} was skipped (overflow): {what}", ranks=[0])
        self._step = None

    def abandon(self) -> None:
        """Forget the open transaction without ending it (the stores were just reset or reloaded)."""
        self._step = None

    def finished(self, step: int) -> bool:
        """Whether the open transaction belongs to a step before ``step`` (so it can be ended now)."""
        return self._step is not None and step != self._step
