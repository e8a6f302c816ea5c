"""What the momentum mode needs to know of the engine's optimizer: the innermost ``torch.optim.Optimizer``,
its parameters per group (:func:`optimizer_params`: ZeRO-3 lends them to their group one sub-group at a time),
its β1 and learning rate, and whether it is an Adam whose update the momentum mode can steer
(``engine/variance.py`` freezes its variance).
"""
from __future__ import annotations

import math
from typing import Any, List, Optional

import torch


def base_optimizer(engine: Any) -> Optional[torch.optim.Optimizer]:
    """The innermost ``torch.optim.Optimizer`` of a DeepSpeed engine (through BF16/FP16/ZeRO wrappers)."""
    opt, seen = getattr(engine, "optimizer", None), 0
    while opt is not None and seen < 8:
        inner = getattr(opt, "optimizer", None)
        if isinstance(opt, torch.optim.Optimizer) and not isinstance(inner, torch.optim.Optimizer):
            return opt
        opt, seen = inner, seen + 1
    return None


def optimizer_params(engine: Any, optimizer: Optional[torch.optim.Optimizer] = None) -> List[List[torch.Tensor]]:
    """The innermost optimizer's parameters per parameter group, in order, as DeepSpeed holds them (at ZeRO 0-2
    its ``param_groups``' ``params``: the fp32 partitions at ZeRO 1/2).

    ZeRO-3 (DeepSpeed 0.19.8 ``runtime/zero/stage3.py`` ``_optimizer_step``) lends each group one fp32 sub-group
    flat at a time: there the lists are ``fp32_partitioned_groups_flat``, grouped by ``sub_group_to_group_id``."""
    opt = base_optimizer(engine) if optimizer is None else optimizer
    groups = getattr(opt, "param_groups", None) or []
    zero = getattr(engine, "optimizer", None)
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)
    owner = getattr(zero, "sub_group_to_group_id", None)
    if flats is not None and owner is not None and zero is not opt:
        lists: List[List[torch.Tensor]] = [[] for _ in groups]
        for i, flat in enumerate(flats):
            lists[owner[i]].append(flat)
        return lists
    return [list(g["params"]) for g in groups]


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


def decoupled(optimizer: Any, group: dict) -> bool:
    """Whether ``optimizer`` decays the weights of ``group`` decoupled from the gradient (AdamW: torch's AdamW or
    Adam with ``decoupled_weight_decay``, DeepSpeed's ``adam_w_mode``)."""
    return (isinstance(optimizer, torch.optim.AdamW) or bool(getattr(optimizer, "adam_w_mode", False))
            or type(optimizer).__name__ in ("AdamW", "FusedAdamW") or bool(group.get("decoupled_weight_decay", False)))


def momentum_refusal(engine: Any) -> Optional[str]:
    """Why the momentum mode cannot serve this engine's optimizer (a sentence fragment naming it), or None.

    It needs Adam's update exactly (Adam, AdamW, FusedAdam/CPUAdam; not NAdam, RAdam, Adamax), one β1 in (0, 1) for
    every group, β2 in (0, 1), no amsgrad, no ``maximize``, and decoupled (AdamW) or zero weight decay (coupled L2
    decay would enter the first moment once per step, not accumulated as Adam does)."""
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
    coupled = [g["weight_decay"] for g in groups if g.get("weight_decay", 0.0) and not decoupled(opt, g)]
    if coupled:
        return f"needs decoupled weight decay (AdamW); this {name} adds weight_decay={coupled[0]} to the gradient"
    return None


__all__ = ["adam_beta1", "base_optimizer", "decoupled", "momentum_refusal", "optimizer_lr", "optimizer_params"]
