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
from . import plan as plan_mod  # noqa: E402
from .plan import DragonnUnsupportedError, Plan  # noqa: E402


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

    For frameworks that call ``deepspeed.initialize`` themselves (Hugging Face ``Trainer``, Accelerate,
    Lightning): call it once, before the framework builds its engine. Configs without an enabled ``"dragonn"``
    block get DeepSpeed's engine untouched. Idempotent; undone by :func:`disable`. Code that did
    ``from deepspeed import initialize`` before this call keeps the original. See docs/frameworks.md.
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


def disable(engine: Any = None) -> None:
    """Undo :func:`enable`: ``deepspeed.initialize`` is DeepSpeed's own again. If another wrapper has gone on
    top of ours since, it is left in place (and keeps calling ours, which keeps working). No-op when not
    enabled.

    Args:
        engine: also take this engine back to DeepSpeed's own: every method ds_dragonn replaced on it, its
            optimizer and overflow checker is removed (``engine/teardown.py`` ``unhook``), so its next
            steps reduce densely; the hook's residuals are dropped. Call it between steps, on every rank. Under
            ``sync: local_steps`` every rank first takes rank 0's weights and optimizer state (collective).
            Without it, engines built meanwhile keep their compression.

    Raises:
        TypeError: ``engine`` is not a DeepSpeed engine (no ``module`` and ``optimizer``).
    """
    global _DEEPSPEED_INITIALIZE
    import deepspeed
    if engine is not None and not (hasattr(engine, "module") and hasattr(engine, "optimizer")):
        raise TypeError(f"ds_dragonn.disable(engine): expected the DeepSpeed engine that ds_dragonn.initialize "
                        f"returned, got {type(engine).__name__}")
    if engine is not None:
        from deepspeed.utils import logger

        from .engine.teardown import unhook
        if getattr(engine, "dragonn", None) is not None:
            engine.dragonn.before_disable()  # (local steps: the ranks take rank 0's weights and optimizer state)
        removed = unhook(engine)
        if removed:
            logger.info(f"DRAGONN: disabled on this engine; DeepSpeed's own again: {', '.join(removed)}")
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

    Takes and returns exactly what ``deepspeed.initialize`` does: ``(engine, optimizer, training_dataloader,
    lr_scheduler)``. The ``"dragonn"`` block is read from the same config and validated before DeepSpeed starts;
    absent or ``"enabled": false``, the engine is returned untouched. See docs/design.md, 'Where it hooks into
    DeepSpeed'.

    Raises:
        DragonnConfigError: the ``"dragonn"`` block has an unknown key or an invalid value.
        DragonnConfigMismatchError: (on every rank) the ranks' ``"dragonn"`` blocks or ZeRO stages differ.
        DragonnUnsupportedError: DRAGONN is enabled with a combination it does not support (ZeRO offload,
            ``"reduce_scatter": false``, a pipeline engine, ``"compress": "momentum"`` with an optimizer it cannot
            serve, ...): each is a row of ``ds_dragonn.plan.RULES``, and the message names the key and value.
        RuntimeError: the installed DeepSpeed no longer has the methods the hook replaces (``engine/probes.py``).
    """
    return _initialize(_deepspeed_initialize(), *args, **kwargs)


def _initialize(ds_initialize: Any, *args: Any, **kwargs: Any):
    """:func:`initialize` around ``ds_initialize`` (DeepSpeed's, or a wrapper that :func:`enable` found)."""
    from .engine import teardown
    from .engine.hooks import hook_row
    teardown.register()  # an orderly exit for every rank (engine/teardown.py: an upstream abort at exit)

    bound = inspect.signature(ds_initialize).bind(*args, **kwargs)
    ds_config = load_ds_config(_resolve_ds_config(bound))
    cfg, refusal = None, None
    facts = plan_mod.Facts.from_ds_config(ds_config)
    try:  # a refusal is raised only after the ranks compared notes: one rank must not leave the others hung
        cfg = DragonnConfig.from_ds_config(ds_config)
        if cfg.enabled:
            from deepspeed.pipe import PipelineModule
            facts = facts.updated(pipeline_model=isinstance(bound.arguments.get("model"), PipelineModule))
            plan_mod.check(cfg, facts, "start")
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
        check_ranks_agree(cfg, facts.stage, refusal=refusal, ds_config=ds_config)
    if refusal is not None:
        raise refusal
    if cfg.enabled:
        _check_deepspeed_version()
        hook_row(cfg.sync.value, facts.stage).check()

    result = ds_initialize(*args, **kwargs)
    if cfg.enabled and getattr(result[0], "dragonn", None) is None:  # (a wrapped wrapper hooked it already)
        _install(result[0], cfg, facts)
    return result


def _engine_facts(engine: Any, facts: plan_mod.Facts, cfg: DragonnConfig) -> plan_mod.Facts:
    """``facts`` with what the engine DeepSpeed built says (its optimizer)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from .engine.adam import momentum_refusal
    from .engine.hooks import hook_row
    from .engine.steps import may_skip_steps
    opt, stage = engine.optimizer, engine.zero_optimization_stage()
    serves = cfg.compress != CompressTarget.gradient and cfg.sync != SyncMode.local_steps
    return facts.updated(stage=stage, optimizer=type(opt).__name__,
                         **hook_row(cfg.sync.value, stage).optimizer_facts(opt),
                         momentum_refusal=(momentum_refusal(engine) or "") if serves else None,
                         bf16_optimizer=isinstance(opt, BF16_Optimizer),
                         may_skip_steps=may_skip_steps(engine), loss_scaler=bool(engine.fp16_enabled()),
                         device=getattr(engine.device, "type", str(engine.device).split(":")[0]))


def _install(engine: Any, cfg: DragonnConfig, facts: plan_mod.Facts) -> None:
    """Check the engine against the table (``plan.RULES``), resolve the plan, install the hook of this engine's
    ZeRO stage / sync mode (``engine/hooks.py``) and log the plan."""
    from deepspeed.utils.logging import print_dist

    from .engine.hooks import hook_row
    from .engine.local_steps import LocalStepsUnsupported
    from .engine.pipelines import HierarchyUnsupported
    facts = _engine_facts(engine, facts, cfg)
    plan_mod.check(cfg, facts, "start")  # (the stage DeepSpeed runs may differ from the config's legacy form)
    plan_mod.check(cfg, facts, "engine")
    cfg, defaults = plan_mod.resolve_defaults(cfg, facts.stage)
    plan = plan_mod.resolve(cfg, facts, defaults)
    for line in plan_mod.compress_lines(cfg, plan, adam=not facts.momentum_refusal):
        print_dist(line, ranks=[0])
    cfg = cfg.model_copy(update={"compress": CompressTarget(plan.compress)})
    hook = hook_row(cfg.sync.value, facts.stage).hook(engine, cfg)
    hook.plan = plan
    try:
        hook.install()
    except (HierarchyUnsupported, LocalStepsUnsupported) as err:  # every rank reached the same decision
        raise DragonnUnsupportedError(str(err)) from None
    hook.plan = plan.with_layout(getattr(hook, "layout", None) is not None, getattr(hook, "exchange_name", plan.exchange))
    print_dist(hook.plan.describe(), ranks=[0])


def _check_deepspeed_version() -> None:
    """Warn (rank 0) where the installed DeepSpeed is not one the hooks were tested with; the hook-point
    checks then refuse a version whose hooked methods changed."""
    import deepspeed
    from deepspeed.utils.logging import print_dist

    from .engine.probes import version_warning
    warning = version_warning(deepspeed.__version__)
    if warning:
        print_dist(warning, ranks=[0])


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


class DragonnConfigMismatchError(DragonnConfigError):
    """The ranks of one data-parallel group were started with different ``"dragonn"`` settings."""


#: keys that do not change which collectives a rank runs (ranks may differ in them)
_LOCAL_KEYS = {"dragonn.log_interval", "dragonn.comm_timeout_s"}


#: DeepSpeed settings that change when and how often the hooks reduce: compared with the "dragonn" block
_DS_AGREED = ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size")


def _flat(d: dict, prefix: str):
    """(dotted key, value) of a nested dict: a mismatch names ``dragonn.advanced.kernel``, not the whole object."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}.{k}")
        else:
            yield f"{prefix}.{k}", v


def check_ranks_agree(cfg: Optional[DragonnConfig], zero_stage: int, group: Any = None,
                      refusal: Optional[BaseException] = None, ds_config: Optional[dict] = None) -> None:
    """Compare every rank's DRAGONN settings (one ``all_gather_object``); raise on every rank when they differ
    or when any rank refused its configuration.

    Ranks that disagree would run different collectives and hang. Called by :func:`initialize` on every rank,
    also where compression is off.

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
    # (the block's own keys: the top-level views of 'advanced' keys would name each mismatch twice)
    dump = None if cfg is None else cfg.model_dump(mode="json", exclude=set(type(cfg).model_computed_fields))
    mine = {"settings": None if cfg is None else {k: v for k, v in _flat(dump, "dragonn") if k not in _LOCAL_KEYS},
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
           "DragonnUnsupportedError", "Plan", "__version__"]
