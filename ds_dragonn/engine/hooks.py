"""Which hook serves a run: one row per (``sync``, ZeRO stage), read by ``ds_dragonn.initialize``.

A row names the hook class, the probe of the DeepSpeed methods it replaces (run before DeepSpeed starts:
``engine/probes.py``), and what the engine's optimizer says about the stage's switches (the ``engine`` rows of
``plan.RULES`` read them). ``sync: local_steps`` runs one hook at every stage (the plan refuses stages 1-3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple


@dataclass(frozen=True)
class HookRow:
    """How one (sync, ZeRO stage) is hooked.

    Attributes:
        hook: the hook class (``HookBase`` subclass), built as ``hook(engine, cfg)``.
        check: the hook point's probe; raises RuntimeError where the installed DeepSpeed changed it.
        optimizer_facts: the engine's optimizer -> ``plan.Facts`` fields ``hooked_optimizer``,
            ``reduce_scatter``, ``contiguous_gradients`` (DeepSpeed's switches as the built optimizer holds them).
    """
    hook: type
    check: Callable[[], None]
    optimizer_facts: Callable[[Any], Dict[str, bool]]


def _stage0_optimizer(opt: Any) -> Dict[str, bool]:
    return {"hooked_optimizer": True, "reduce_scatter": True, "contiguous_gradients": True}


def _zero12_optimizer(opt: Any) -> Dict[str, bool]:
    hooked = hasattr(opt, "average_tensor")
    return {"hooked_optimizer": hooked,
            "reduce_scatter": bool(getattr(opt, "reduce_scatter", True)) if hooked else True,
            "contiguous_gradients": bool(getattr(opt, "contiguous_gradients", True)) if hooked else True}


def _zero3_optimizer(opt: Any) -> Dict[str, bool]:
    from .stage3 import HOOKED
    hooked = hasattr(opt, HOOKED)
    return {"hooked_optimizer": hooked,
            "reduce_scatter": bool(getattr(opt, "reduce_scatter", True)) if hooked else True,
            "contiguous_gradients": True}


def _unknown_optimizer(opt: Any) -> Dict[str, bool]:
    return {"hooked_optimizer": False, "reduce_scatter": True, "contiguous_gradients": True}


def _rows() -> Dict[Tuple[str, int], HookRow]:
    from .local_steps import LocalStepsHook, check_local_steps_hook_point
    from .stage0 import Stage0Hook, check_hook_point
    from .stage3 import Stage3Hook, check_zero3_hook_point
    from .stage_1_and_2 import Stage12Hook, check_zero_hook_point
    zero = {0: HookRow(Stage0Hook, check_hook_point, _stage0_optimizer),
            1: HookRow(Stage12Hook, check_zero_hook_point, _zero12_optimizer),
            2: HookRow(Stage12Hook, check_zero_hook_point, _zero12_optimizer),
            3: HookRow(Stage3Hook, check_zero3_hook_point, _zero3_optimizer)}
    rows = {("every_step", s): row for s, row in zero.items()}
    rows.update({("local_steps", s): HookRow(LocalStepsHook, check_local_steps_hook_point, row.optimizer_facts)
                 for s, row in zero.items()})
    return rows


def hook_row(sync: str, stage: int) -> HookRow:
    """The row of ``sync`` (``"every_step"`` / ``"local_steps"``) at ZeRO ``stage``. A stage DeepSpeed does not
    have (it refuses that config itself) gets the stage-1 probe and an unhooked optimizer."""
    rows = _rows()
    fallback = rows[(sync, 1)]
    return rows.get((sync, stage), HookRow(fallback.hook, fallback.check, _unknown_optimizer))


__all__ = ["HookRow", "hook_row"]
