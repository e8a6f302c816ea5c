"""ds_dragonn — DRAGONN hash-sampled gradient sparsification for DeepSpeed's gradient allreduce.

Use :func:`initialize` exactly like ``deepspeed.initialize``; a ``"dragonn"`` block in the DeepSpeed
config switches compression on (see ``ds_dragonn.config.DragonnConfig``).
"""
from __future__ import annotations

import inspect
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
    With the block absent or ``"enabled": false`` the engine is returned untouched.

    Raises:
        DragonnConfigError: the ``"dragonn"`` block has an unknown key or an invalid value.
        DragonnUnsupportedError: DRAGONN is enabled together with ZeRO stage >= 1 or a pipeline engine.
    """
    import deepspeed
    from .engine import DragonnHook, check_hook_point

    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    ds_config = load_ds_config(_resolve_ds_config(bound))
    cfg = DragonnConfig.from_ds_config(ds_config)
    if cfg.enabled:
        zero = ds_config.get("zero_optimization") or {}
        stage = zero.get("stage", 0) if isinstance(zero, dict) else zero  # legacy form: true = ZeRO on
        if stage not in (0, None, False):
            raise DragonnUnsupportedError(
                f"'dragonn' compresses the ZeRO stage-0 gradient allreduce; 'zero_optimization.stage' is {stage}. "
                f"Set the stage to 0 or 'dragonn.enabled' to false")
        from deepspeed.pipe import PipelineModule
        if isinstance(bound.arguments.get("model"), PipelineModule):
            raise DragonnUnsupportedError("'dragonn' does not support the pipeline engine (PipelineModule model)")
        check_hook_point()

    result = deepspeed.initialize(*args, **kwargs)
    if cfg.enabled:
        engine = result[0]
        if engine.zero_optimization_stage() != 0:
            raise DragonnUnsupportedError(
                f"'dragonn' needs ZeRO stage 0, the engine runs stage {engine.zero_optimization_stage()}")
        DragonnHook(engine, cfg).install()
    return result


__all__ = ["initialize", "DragonnConfig", "DragonnConfigError", "DragonnUnsupportedError", "__version__"]
