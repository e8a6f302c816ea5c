"""ds_dragonn — DRAGONN hash-sampled gradient sparsification for DeepSpeed's gradient allreduce.

Use :func:`initialize` exactly like ``deepspeed.initialize``; a ``"dragonn"`` block in the DeepSpeed
config switches compression on (see ``ds_dragonn.config.DragonnConfig``). Under a framework that calls
``deepspeed.initialize`` itself (Hugging Face ``Trainer``, Accelerate, Lightning), call :func:`enable` once
before it does: without it DeepSpeed ignores the block (it does not validate unknown top-level keys).
"""
from __future__ import annotations

import datetime
import inspect
import json
from typing import Any, Optional

__version__ = "0.1.0"

from .config import CompressTarget, DragonnConfig, DragonnConfigError, SyncMode, load_ds_config  # noqa: E402
from .engine.checkpoint import CheckpointError, CheckpointMismatchError  # noqa: E402


class DragonnUnsupportedError(ValueError):
    """DRAGONN was enabled with a DeepSpeed setting it does not support (ZeRO stage 3, ZeRO offload, a pipeline
    engine, ...: the list is in :func:`initialize`)."""


def _resolve_ds_config(bound: inspect.BoundArguments) -> Any:
    args = bound.arguments.get("args")
    for attr in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, attr, None) if args is not None else None
        if value is not None:
            return value
    if bound.arguments.get("config") is not None:
        return bound.arguments["config"]
    return bound.arguments.get("config_params")


#: ``deepspeed.initialize`` as it was before :func:`enable` replaced it (None while not enabled)
_DEEPSPEED_INITIALIZE: Optional[Any] = None


def enable() -> None:
    """Make ``deepspeed.initialize`` itself honour the ``"dragonn"`` block, for every caller in this process.

    For frameworks that call ``deepspeed.initialize`` themselves: Hugging Face ``Trainer``
    (``TrainingArguments(deepspeed=...)``), Accelerate (``DeepSpeedPlugin``) and Lightning
    (``DeepSpeedStrategy``). Call it once, before the framework builds its engine (e.g. right after the
    imports); ``deepspeed.initialize`` is then :func:`initialize`, with the same signature and return values.
    Configs without an enabled ``"dragonn"`` block get DeepSpeed's engine untouched. Idempotent; undone by
    :func:`disable`. It replaces the attribute of the ``deepspeed`` module: code that did
    ``from deepspeed import initialize`` before this call keeps the original. Another wrapper around
    ``deepspeed.initialize`` (before or after this call) keeps working: each wrapper calls the function it
    wrapped, and an engine is hooked once.
    """
    global _DEEPSPEED_INITIALIZE
    import functools

    import deepspeed
    current = deepspeed.initialize
    if getattr(current, "__ds_dragonn__", False):  # ours already (also after a reload of this module)
        _DEEPSPEED_INITIALIZE = current.__ds_dragonn_original__
        return
    @functools.wraps(current)
    def initialize_with_dragonn(*args: Any, **kwargs: Any):
        return _initialize(current, *args, **kwargs)

    initialize_with_dragonn.__signature__ = inspect.signature(current)
    initialize_with_dragonn.__ds_dragonn__ = True
    initialize_with_dragonn.__ds_dragonn_original__ = current
    _DEEPSPEED_INITIALIZE = current
    deepspeed.initialize = initialize_with_dragonn
    from deepspeed.utils import logger
    logger.info("DRAGONN: enabled; deepspeed.initialize now honours the 'dragonn' config block")


def disable() -> None:
    """Undo :func:`enable`: ``deepspeed.initialize`` is DeepSpeed's own again (engines built meanwhile keep
    their compression). If another wrapper has gone on top of ours since, it is left in place (and keeps
    calling ours, which keeps working). No-op when not enabled."""
    global _DEEPSPEED_INITIALIZE
    import deepspeed
    if _DEEPSPEED_INITIALIZE is None:
        return
    if getattr(deepspeed.initialize, "__ds_dragonn__", False):
        deepspeed.initialize = deepspeed.initialize.__ds_dragonn_original__
    _DEEPSPEED_INITIALIZE = None


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _DEEPSPEED_INITIALIZE is not None


def _deepspeed_initialize() -> Any:
    """The ``initialize`` that :func:`initialize` wraps: the one :func:`enable` replaced, else
    ``deepspeed.initialize`` (never a wrapper of ours: that would recurse)."""
    import deepspeed
    if _DEEPSPEED_INITIALIZE is not None:
        return _DEEPSPEED_INITIALIZE
    fn = deepspeed.initialize
    while getattr(fn, "__ds_dragonn__", False):
        fn = fn.__ds_dragonn_original__
    return fn


def initialize(*args: Any, **kwargs: Any):
    """``deepspeed.initialize`` with DRAGONN gradient compression when the config enables it.

    Takes and returns exactly what ``deepspeed.initialize`` does: ``(engine, optimizer,
    training_dataloader, lr_scheduler)``. The ``"dragonn"`` block is read from the same config
    (``args.deepspeed_config``, ``config=`` dict or JSON path) and validated before DeepSpeed starts.
    With the block absent or ``"enabled": false`` the engine is returned untouched. ZeRO stage 0 hooks the
    engine's gradient allreduce, stages 1 and 2 the ZeRO optimizer's gradient reduce-scatter.

    Raises:
        DragonnConfigError: the ``"dragonn"`` block has an unknown key or an invalid value.
        DragonnConfigMismatchError: (on every rank) the ranks' ``"dragonn"`` blocks or ZeRO stages differ.
        DragonnUnsupportedError: DRAGONN is enabled together with ZeRO stage 3, ZeRO offload,
            ``"reduce_scatter": false``, ``"contiguous_gradients": false`` or a pipeline engine, or
            ``"compress": "momentum"`` with an optimizer it cannot serve (not Adam-type, amsgrad, L2 decay).
    """
    return _initialize(_deepspeed_initialize(), *args, **kwargs)


def _initialize(ds_initialize: Any, *args: Any, **kwargs: Any):
    """:func:`initialize` around ``ds_initialize`` (DeepSpeed's, or a wrapper that :func:`enable` found)."""
    from .engine import check_hook_point, check_zero_hook_point
    from .engine import teardown
    teardown.register()  # an orderly exit for every rank (engine/teardown.py: an upstream abort at exit)

    bound = inspect.signature(ds_initialize).bind(*args, **kwargs)
    ds_config = load_ds_config(_resolve_ds_config(bound))
    cfg, stage, refusal = None, 0, None
    try:  # a refusal is raised only after the ranks compared notes: one rank must not leave the others hung
        cfg = DragonnConfig.from_ds_config(ds_config)
        zero = ds_config.get("zero_optimization") or {}
        stage = _zero_stage(zero)
        if cfg.enabled:
            _check_zero(stage, zero if isinstance(zero, dict) else {}, ds_config, cfg)
            from deepspeed.pipe import PipelineModule
            if isinstance(bound.arguments.get("model"), PipelineModule):
                raise DragonnUnsupportedError("'dragonn' does not support the pipeline engine (PipelineModule model)")
    except (DragonnConfigError, DragonnUnsupportedError) as err:
        refusal = err
    if _multi_rank():
        import deepspeed.comm as ds_dist
        from deepspeed.accelerator import get_accelerator
        # what deepspeed.initialize does first anyway (idempotent), so that the ranks can talk now
        timeout = {} if cfg is None or cfg.comm_timeout_s is None else \
            {"timeout": datetime.timedelta(seconds=cfg.comm_timeout_s)}
        ds_dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                 distributed_port=bound.arguments.get("distributed_port", 29500),
                                 dist_init_required=bound.arguments.get("dist_init_required"), **timeout)
        check_ranks_agree(cfg, stage, refusal=refusal, ds_config=ds_config)
    if refusal is not None:
        raise refusal
    if cfg.enabled and cfg.sync == SyncMode.local_steps:
        from .engine.local_steps import check_local_steps_hook_point
        check_local_steps_hook_point()
    elif cfg.enabled:
        if stage == 3:
            from .engine.stage3 import check_zero3_hook_point
            check_zero3_hook_point()
        else:
            check_hook_point() if stage == 0 else check_zero_hook_point()

    result = ds_initialize(*args, **kwargs)
    if cfg.enabled and getattr(result[0], "dragonn", None) is None:  # (a wrapped wrapper hooked it already)
        engine = result[0]
        cfg = _resolve_compress(cfg, engine)  # ("warmup_steps": "auto" is resolved by the hook)
        stage = engine.zero_optimization_stage()
        from .engine.pipelines import HierarchyUnsupported
        try:
            _install(engine, cfg, stage)
        except HierarchyUnsupported as err:  # every rank reached the same decision (a gathered layout)
            raise DragonnUnsupportedError(str(err)) from None
    return result


def _install(engine: Any, cfg: DragonnConfig, stage: int) -> None:
    """Install the hook of this engine's ZeRO stage / sync mode (refusing what it cannot serve)."""
    from .engine import Stage0Hook, Stage12Hook
    if cfg.sync == SyncMode.local_steps:
        from .engine.local_steps import LocalStepsHook, LocalStepsUnsupported
        if stage != 0:
            raise DragonnUnsupportedError(_LOCAL_STEPS_ZERO.format(stage=stage))
        try:
            LocalStepsHook(engine, cfg).install()
        except LocalStepsUnsupported as err:
            raise DragonnUnsupportedError(str(err)) from None
    elif stage == 0:
        Stage0Hook(engine, cfg).install()
    elif stage == 3:
        from .engine.stage3 import HOOKED, Stage3Hook
        if not hasattr(engine.optimizer, HOOKED):
            raise DragonnUnsupportedError(f"'dragonn' at ZeRO stage 3 hooks DeepSpeedZeroOptimizer_Stage3; the "
                                          f"engine runs {type(engine.optimizer).__name__}")
        if not getattr(engine.optimizer, "reduce_scatter", True):  # e.g. "reduce_scatter": "false" (a string)
            raise DragonnUnsupportedError("'dragonn' with ZeRO stage 3 does not support 'zero_optimization."
                                          "reduce_scatter': false (a dense path the hook does not see); remove it")
        Stage3Hook(engine, cfg).install()
    elif stage in (1, 2) and hasattr(engine.optimizer, "average_tensor"):
        if not engine.optimizer.reduce_scatter:
            raise DragonnUnsupportedError(_NO_REDUCE_SCATTER)
        Stage12Hook(engine, cfg).install()
    else:
        raise DragonnUnsupportedError(f"'dragonn' supports ZeRO stages 0-3; the engine runs stage {stage} "
                                      f"with {type(engine.optimizer).__name__}")


def _resolve_compress(cfg: DragonnConfig, engine: Any) -> DragonnConfig:
    """``cfg`` with ``compress`` resolved for this engine's optimizer: ``auto`` becomes ``momentum`` for an
    Adam-type optimizer the momentum mode serves (and ``gradient`` otherwise, or where error feedback is off,
    there is no dense warm-up or the density is 1); an explicit ``momentum`` it cannot serve is refused.

    Raises:
        DragonnUnsupportedError: ``compress: momentum`` with an optimizer without ``betas``, with betas[0]
            outside (0, 1), amsgrad, or coupled (L2) weight decay, naming the optimizer and what is wrong.
    """
    from deepspeed.utils.logging import print_dist

    from .config import MOMENTUM_KEYS
    from .engine.adam import momentum_refusal
    if cfg.compress == CompressTarget.gradient:
        return cfg
    if cfg.sync == SyncMode.local_steps:  # the pseudo-gradient is what is compressed
        return cfg.model_copy(update={"compress": CompressTarget.gradient})
    why = momentum_refusal(engine)
    if cfg.compress == CompressTarget.momentum:
        if why:
            raise DragonnUnsupportedError(f"'dragonn.compress': 'momentum' {why}. Use 'compress': 'gradient' with it")
        return cfg
    unmet = [what for what, ok in (("error feedback is off", cfg.error_feedback),
                                   ("warmup_steps is 0: no dense steps to estimate Adam's variance from",
                                    cfg.warmup_steps != 0),
                                   ("density is 1.0", cfg.density < 1.0)) if not ok]
    fits = not why and not unmet
    resolved = CompressTarget.momentum if fits else CompressTarget.gradient
    reason = "an Adam-type optimizer" if fits else (f"the momentum mode {why}" if why else "; ".join(unmet))
    print_dist(_auto_line(resolved, reason, adam=not why), ranks=[0])
    refresh = cfg.given(*MOMENTUM_KEYS)
    if refresh and resolved == CompressTarget.gradient:
        print_dist(f"DRAGONN: warning: 'dragonn.{refresh[0]}' has no effect: it applies to the momentum mode, and "
                   f"compress 'auto' chose 'gradient' ({reason})", ranks=[0])
    return cfg.model_copy(update={"compress": resolved})


def _auto_line(resolved: CompressTarget, reason: str, adam: bool) -> str:
    """The start-up line of ``compress: auto``: which mode runs and why, in plain words; a warning where an
    Adam-type optimizer gets the gradient mode (it costs quality: docs/tuning.md)."""
    if resolved == CompressTarget.momentum:
        return (f"DRAGONN: compress 'auto' -> 'momentum' ({reason}): each rank's Adam momentum is sparsified, and "
                f"Adam's variance is frozen from the dense warm-up (refreshed every "
                f"'advanced.variance_refresh_steps')")
    if not adam:
        return f"DRAGONN: compress 'auto' -> 'gradient' ({reason}): the gradient is sparsified, the optimizer unchanged"
    return (f"DRAGONN: warning: compress 'auto' -> 'gradient' although the optimizer is Adam-type, because {reason}. "
            f"With Adam the gradient mode costs quality (docs/tuning.md#3-warm-ups); keep the dense warm-up (leave "
            f"'warmup_steps' out) to get the momentum mode, or set 'compress': 'gradient' to choose this one")


def _check_zero3(zero: dict, ds_config: dict, cfg: Optional[DragonnConfig]) -> None:
    """What the ZeRO-3 hook (``engine/stage3.py``) does not cover, refused by key before DeepSpeed starts."""
    def refuse(what: str) -> None:
        raise DragonnUnsupportedError(f"'dragonn' with ZeRO stage 3 does not support {what}; remove it, or set "
                                      f"'dragonn.enabled' to false")
    for key in ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param"):  # (the last two: legacy)
        value = zero.get(key)
        if value and (not isinstance(value, dict) or value.get("device", "cpu") not in (None, "none")):
            refuse(f"'zero_optimization.{key}' ({value!r}: ZeRO-Infinity / offload)")
    if zero.get("zero_quantized_gradients"):
        refuse("'zero_optimization.zero_quantized_gradients' (qgZ compresses the same reduce-scatter)")
    if zero.get("reduce_scatter", True) is False:
        refuse("'zero_optimization.reduce_scatter': false (a dense path the hook does not see)")
    if zero.get("zenflow"):
        refuse("'zero_optimization.zenflow' (ZenFlow's selective updates on offloaded optimizer states)")
    if ds_config.get("gradient_predivide_factor", 1.0) != 1.0:
        refuse(f"'gradient_predivide_factor' ({ds_config['gradient_predivide_factor']!r}: ZeRO-3 then scales the "
               f"reduce-scatter in a way the hook does not reproduce, and would leave it dense)")


_NO_REDUCE_SCATTER = ("'dragonn' compresses the gradient reduce-scatter of ZeRO stages 1/2, but "
                      "'zero_optimization.reduce_scatter' is false (a dense allreduce); remove the key or set it to true")


def _zero_stage(zero: Any) -> int:
    """The ZeRO stage of a ``zero_optimization`` value (dict, or the legacy bool/int form)."""
    stage = zero.get("stage", 0) if isinstance(zero, dict) else zero
    if stage is True:
        return 1
    try:
        return int(stage or 0)
    except (TypeError, ValueError):
        return -1  # DeepSpeed rejects it with its own message


def _multi_rank() -> bool:
    """Whether this process is one of several (launcher environment or a started process group)."""
    import os
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


_LOCAL_STEPS_ZERO = ("'dragonn.sync': 'local_steps' needs every rank's own full optimizer state and fp32 weights "
                     "(each rank steps alone between syncs); ZeRO stage {stage} partitions them across the ranks. "
                     "Use 'zero_optimization.stage': 0, or 'sync': 'every_step'")


def _check_zero(stage: int, zero: dict, ds_config: dict, cfg: Optional[DragonnConfig] = None) -> None:
    """Refuse what the hooks do not cover, before DeepSpeed starts (a clear error instead of a wrong result)."""
    if cfg is not None and cfg.sync == SyncMode.local_steps and stage != 0:
        raise DragonnUnsupportedError(_LOCAL_STEPS_ZERO.format(stage=stage))
    if cfg is not None and stage != 0 and cfg.given("dense_values"):
        raise DragonnUnsupportedError(f"'dragonn.advanced.dense_values' applies to ZeRO stage 0 only (at stage "
                                      f"{stage} the dense steps are DeepSpeed's own reduce-scatter); remove it")
    if stage == 3:
        _check_zero3(zero, ds_config, cfg)
    if stage in (1, 2):
        bf16 = (ds_config.get("bf16") or {}).get("enabled") is True
        accum = str((ds_config.get("data_types") or {}).get("grad_accum_dtype", "")).lower()
        if stage == 1 and bf16 and accum in ("fp32", "float32", "float") and not zero.get("offload_optimizer"):
            raise DragonnUnsupportedError(
                "'dragonn' with ZeRO stage 1, bf16 and 'data_types.grad_accum_dtype': 'fp32': DeepSpeed runs its "
                "BF16_Optimizer there, whose gradient reduction ds_dragonn does not hook. Use ZeRO stage 2 (which "
                "supports fp32 accumulation) or drop 'grad_accum_dtype'")
        if zero.get("reduce_scatter", True) is False:
            raise DragonnUnsupportedError(_NO_REDUCE_SCATTER)
        if zero.get("contiguous_gradients", True) is False:
            raise DragonnUnsupportedError(
                f"'dragonn' with ZeRO stage {stage} compresses the contiguous gradient buckets; "
                f"'zero_optimization.contiguous_gradients' is false (DeepSpeed then reduces gradient lists through "
                f"another path, which would stay dense). Remove the key or set it to true")
        for key in ("offload_optimizer", "offload_param", "cpu_offload"):
            value = zero.get(key)
            if value and (not isinstance(value, dict) or value.get("device", "cpu") not in (None, "none")):
                raise DragonnUnsupportedError(
                    f"'dragonn' with ZeRO stage {stage} does not support 'zero_optimization.{key}' ({value!r}): "
                    f"remove it, or set 'dragonn.enabled' to false")




class DragonnConfigMismatchError(DragonnConfigError):
    """The ranks of one data-parallel group were started with different ``"dragonn"`` settings."""


#: keys that do not change which collectives a rank runs (ranks may differ in them)
_LOCAL_KEYS = {"dragonn.log_interval", "dragonn.comm_timeout_s"}


#: DeepSpeed settings that change when and how often the hooks reduce: compared with the "dragonn" block
_DS_AGREED = ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size")


def check_ranks_agree(cfg: Optional[DragonnConfig], zero_stage: int, group: Any = None,
                      refusal: Optional[BaseException] = None, ds_config: Optional[dict] = None) -> None:
    """Compare every rank's DRAGONN settings (one ``all_gather_object``); raise on every rank when they differ
    or when any rank refused its configuration.

    Ranks that disagree would otherwise run different collectives (one compresses, another runs DeepSpeed's
    allreduce) and hang; a rank that refuses its configuration alone would leave the others waiting in
    DeepSpeed's start-up. Called by :func:`initialize` on every rank, also where compression is off.

    Args:
        cfg: this rank's validated block (None when it was invalid: then ``refusal`` says why).
        zero_stage: this rank's ZeRO stage.
        refusal: the error this rank is about to raise, if any.
        ds_config: this rank's DeepSpeed config; its batch and accumulation settings (``_DS_AGREED``) are
            compared too (ZeRO 2 reduces at every micro step: ranks with different accumulation hang).
    Raises:
        DragonnConfigMismatchError: on every rank (a refusing rank raises its own error instead, after the
            exchange), naming each differing field with every rank's value, or the rank that refused and why.
    """
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group=group) == 1:
        return
    mine = {"settings": None if cfg is None else {f"dragonn.{k}": v for k, v in cfg.model_dump(mode="json").items()
                                                  if f"dragonn.{k}" not in _LOCAL_KEYS},
            "enabled": bool(cfg is not None and cfg.enabled), "stage": zero_stage,
            "ds": {k: (ds_config or {}).get(k) for k in _DS_AGREED},
            "refusal": None if refusal is None else f"{type(refusal).__name__}: {refusal}"}
    everyone: list = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(everyone, mine, group=group)
    rank = dist.get_rank(group=group)
    refused = [(r, v["refusal"]) for r, v in enumerate(everyone) if v["refusal"]]
    if refused:
        if refusal is not None:
            return  # the caller raises its own error
        r, why = refused[0]
        first = why.splitlines()[0] + (" ..." if len(why.splitlines()) > 1 else "")
        raise DragonnConfigMismatchError(f"[rank {rank}] rank {r} refused its DRAGONN configuration, so every rank "
                                         f"stops ({first})")
    if not any(v["enabled"] for v in everyone):
        return  # compression off everywhere: nothing to agree on
    merged = [dict(v["settings"] or {}, **{"zero_optimization.stage": v["stage"]}, **v.get("ds", {}))
              for v in everyone]
    keys = sorted(set().union(*merged))
    diffs = [f"{key}: " + ", ".join(f"rank {r}: {json.dumps(m.get(key))}" for r, m in enumerate(merged))
             for key in keys if len({json.dumps(m.get(key), sort_keys=True) for m in merged}) > 1]
    if diffs:
        raise DragonnConfigMismatchError(f"[rank {rank}] ranks disagree on the DRAGONN settings, which would make "
                                         f"them run different collectives and hang: " + "; ".join(diffs))


__all__ = ["initialize", "enable", "disable", "is_enabled", "check_ranks_agree", "CheckpointError", "CheckpointMismatchError", "DragonnConfig", "DragonnConfigError", "DragonnConfigMismatchError",
           "DragonnUnsupportedError", "__version__"]
