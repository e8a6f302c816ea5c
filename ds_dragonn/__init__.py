"""ds_dragonn — DRAGONN hash-sampled gradient sparsification for DeepSpeed's gradient allreduce.

Use :func:`initialize` exactly like ``deepspeed.initialize``; a ``"dragonn"`` block in the DeepSpeed
config switches compression on (see ``ds_dragonn.config.DragonnConfig``).
"""
from __future__ import annotations

import inspect
import json
from typing import Any

__version__ = "0.1.0"

from .config import DragonnConfig, DragonnConfigError, load_ds_config  # noqa: E402


class DragonnUnsupportedError(ValueError):
    """DRAGONN was enabled with a DeepSpeed setting it does not support (e.g. ZeRO stage >= 1)."""


def _resolve_ds_config(bound: inspect.BoundArguments) -> Any:
    args = bound.arguments.get("args")
    for attr in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, attr, None) if args is not None else None
        if value is not None:
            return value
    if bound.arguments.get("config") is not None:
        return bound.arguments["config"]
    return bound.arguments.get("config_params")


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
            ``"reduce_scatter": false``, ``"contiguous_gradients": false`` or a pipeline engine.
    """
    import deepspeed
    from .engine import DragonnHook, ZeroHook, check_hook_point, check_zero_hook_point

    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    ds_config = load_ds_config(_resolve_ds_config(bound))
    cfg = DragonnConfig.from_ds_config(ds_config)
    if cfg.enabled:
        zero = ds_config.get("zero_optimization") or {}
        stage = zero.get("stage", 0) if isinstance(zero, dict) else zero  # legacy form: true = ZeRO on
        stage = 1 if stage is True else int(stage or 0)
        _check_zero(stage, zero if isinstance(zero, dict) else {})
        from deepspeed.pipe import PipelineModule
        if isinstance(bound.arguments.get("model"), PipelineModule):
            raise DragonnUnsupportedError("'dragonn' does not support the pipeline engine (PipelineModule model)")
        check_hook_point() if stage == 0 else check_zero_hook_point()

    result = deepspeed.initialize(*args, **kwargs)
    engine = result[0]
    from deepspeed.utils import groups
    check_ranks_agree(cfg, int(engine.zero_optimization_stage()), groups._get_sequence_data_parallel_group())
    if cfg.enabled:
        stage = engine.zero_optimization_stage()
        if stage == 0:
            DragonnHook(engine, cfg).install()
        elif stage in (1, 2) and hasattr(engine.optimizer, "average_tensor"):
            if not engine.optimizer.reduce_scatter:
                raise DragonnUnsupportedError(_NO_REDUCE_SCATTER)
            ZeroHook(engine, cfg).install()
        else:
            raise DragonnUnsupportedError(f"'dragonn' supports ZeRO stages 0, 1 and 2; the engine runs stage {stage} "
                                          f"with {type(engine.optimizer).__name__}")
    return result


_NO_REDUCE_SCATTER = ("'dragonn' compresses the gradient reduce-scatter of ZeRO stages 1/2, but "
                      "'zero_optimization.reduce_scatter' is false (a dense allreduce); remove the key or set it to true")


def _check_zero(stage: int, zero: dict) -> None:
    """Refuse what the hooks do not cover, before DeepSpeed starts (a clear error instead of a wrong result)."""
    if stage >= 3:
        raise DragonnUnsupportedError(
            f"'dragonn' compresses the gradient reduction of ZeRO stages 0, 1 and 2; 'zero_optimization.stage' is "
            f"{stage} (stage 3 reduces gradients inside its parameter partitioning, which ds_dragonn does not hook; "
            f"DeepSpeed's ZeRO++ qgZ compresses stage 3). Use stage 0-2 or set 'dragonn.enabled' to false")
    if stage in (1, 2):
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


def check_ranks_agree(cfg: DragonnConfig, zero_stage: int, group: Any = None) -> None:
    """Every rank raises :class:`DragonnConfigMismatchError` naming each field and each rank's value when the
    ranks' ``"dragonn"`` blocks (or ZeRO stages) differ; nothing when they agree.

    Ranks that disagree would otherwise run different collectives (one compresses, another runs
    DeepSpeed's allreduce) and hang. One ``all_gather_object`` at ``initialize``, on every rank, also
    where compression is off: a rank with ``"enabled": false`` is caught too.
    """
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group=group) == 1:
        return
    mine = {f"dragonn.{k}": v for k, v in cfg.model_dump(mode="json").items()}
    mine["zero_optimization.stage"] = zero_stage
    everyone: list = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(everyone, mine, group=group)
    diffs = [f"{key}: " + ", ".join(f"rank {r}: {json.dumps(v.get(key))}" for r, v in enumerate(everyone))
             for key in sorted(mine) if len({json.dumps(v.get(key), sort_keys=True) for v in everyone}) > 1]
    if diffs:
        raise DragonnConfigMismatchError(f"[rank {dist.get_rank(group=group)}] ranks disagree on the DRAGONN "
                                         f"settings, which would make them run different collectives and hang: "
                                         + "; ".join(diffs))


__all__ = ["initialize", "check_ranks_agree", "DragonnConfig", "DragonnConfigError", "DragonnConfigMismatchError",
           "DragonnUnsupportedError", "__version__"]
