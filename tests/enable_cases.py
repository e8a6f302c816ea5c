"""Rank functions for tests/test_enable.py: engines built by plain ``deepspeed.initialize`` (what Hugging Face
Trainer, Accelerate and Lightning call) after ``ds_dragonn.enable()``."""
from __future__ import annotations

import inspect
from pathlib import Path

import torch

from tests.engines import engine_config, init_distributed, zero_config

LAYERS = (32, 64, 4)
STEPS = 3
RUNS = {
    "s0_d1": engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1}),
    "s0_dense": engine_config(None),
    "s0_d001": engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1}),
    "s2_d1": zero_config(2, {"enabled": True, "density": 1.0}),
    "s2_dense": zero_config(2, None),
    "s2_d001": zero_config(2, {"enabled": True, "density": 0.01}),
    "s0_disabled_block": engine_config({"enabled": False, "density": 0.01}),
}
#: Adam and the momentum mode: the hook also registers an optimizer step pre-hook (the variance freeze)
MOMENTUM = dict(engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1, "compress": "momentum",
                               "warmup_steps": 1}), optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
MOMENTUM_DENSE = dict(engine_config(None), optimizer=MOMENTUM["optimizer"])


def _ours(obj) -> list:
    """The instance attributes of ``obj`` that are functions of ds_dragonn (what a hook put there)."""
    return sorted(n for n, v in vars(obj).items()
                  if callable(v) and getattr(getattr(v, "__func__", v), "__module__", "").startswith("ds_dragonn."))


def _patched(engine) -> list:
    objs = (engine, engine.optimizer, getattr(engine.optimizer, "overflow_checker", None))
    return [f"{type(o).__name__}.{n}" for o in objs if o is not None for n in _ours(o)] + \
        (["dragonn"] if "dragonn" in vars(engine) else [])


def _train_plain(cfg: dict, rank: int, disable: bool = False):
    """The seeded MLP of tests.engines.train_mlp, built by plain ``deepspeed.initialize`` (``disable``: by
    ``ds_dragonn.initialize``, then ``ds_dragonn.disable(engine)`` before the first step)."""
    import deepspeed

    import ds_dragonn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.Tanh(),
                                torch.nn.Linear(LAYERS[1], LAYERS[2]))
    init = ds_dragonn.initialize if disable else deepspeed.initialize
    result = init(model=model, model_parameters=model.parameters(), config=cfg)
    engine = result[0]
    patched = _patched(engine)
    if disable:
        ds_dragonn.disable(engine)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(8, LAYERS[0], generator=g)
        y = torch.randint(0, LAYERS[2], (8,), generator=g)
        engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        engine.step()
    hook = getattr(engine, "dragonn", None)
    return {"n_results": len(result), "engine_type": type(engine).__name__, "patched": patched,
            "left": _patched(engine),
            "params": [p.detach().clone() for p in engine.module.parameters()],
            "compressed": None if hook is None else hook.telemetry.compressed_reductions}


#: local steps with Adam in bf16: between syncs each rank holds its own weights, masters and Adam state
LOCAL = dict(engine_config({"enabled": True, "sync": "local_steps", "warmup_steps": 1, "local_steps": 2}, bf16=True),
             optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}})


def _local_steps_then_disable(rank: int, before: int = 4, after: int = 2) -> dict:
    """``before`` steps under local steps (the last one local: the ranks differ), ``disable(engine)``, then
    ``after`` dense steps: the weights after each step."""
    import ds_dragonn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.Tanh(),
                                torch.nn.Linear(LAYERS[1], LAYERS[2]))
    engine = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=LOCAL)[0]
    g = torch.Generator().manual_seed(rank)
    weights = []
    for step in range(before + after):
        if step == before:
            ds_dragonn.disable(engine)
        x = torch.randn(8, LAYERS[0], generator=g).to(torch.bfloat16)
        y = torch.randint(0, LAYERS[2], (8,), generator=g)
        engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
        engine.step()
        weights.append(torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()]))
    return {"weights": weights, "left": _patched(engine)}


def enabled_runs(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    import deepspeed

    import ds_dragonn
    original = deepspeed.initialize
    out = {"before": _train_plain(RUNS["s0_d001"], rank)}  # not enabled yet: the block is ignored
    ds_dragonn.enable()
    ds_dragonn.enable()  # idempotent
    out["wrapped_once"] = deepspeed.initialize is not original and ds_dragonn._deepspeed_initialize() is original
    out["same_signature"] = inspect.signature(deepspeed.initialize) == inspect.signature(original)
    for name, cfg in RUNS.items():
        out[name] = _train_plain(cfg, rank)
    ds_dragonn.disable()
    out["restored"] = deepspeed.initialize is original
    # another wrapper goes on top of ours, then disable(): the chain still works, no recursion, hooked once
    ds_dragonn.enable()
    ours = deepspeed.initialize
    deepspeed.initialize = lambda *a, **k: ours(*a, **k)
    ds_dragonn.disable()
    out["foreign_wrapper"] = _train_plain(RUNS["s0_d001"], rank)
    out["foreign_wrapper_via_ds_dragonn"] = ds_dragonn.initialize(
        model=torch.nn.Linear(4, 4), config=RUNS["s0_d001"])[0].dragonn is not None
    deepspeed.initialize = original
    for stage in (0, 2):  # disable(engine) on a hooked engine: DeepSpeed's own again, bit for bit
        out[f"s{stage}_disabled_engine"] = _train_plain(RUNS[f"s{stage}_d001"], rank, disable=True)
    out["s0_momentum_disabled_engine"] = _train_plain(MOMENTUM, rank, disable=True)
    out["s0_momentum_dense"] = _train_plain(MOMENTUM_DENSE, rank)
    out["local_steps_disabled"] = _local_steps_then_disable(rank)
    torch.save(out, Path(out_dir) / f"enable_rank{rank}.pt")
    torch.distributed.destroy_process_group()
