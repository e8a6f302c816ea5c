"""What the multi-rank engine cases share: the gloo process group, the "dragonn" settings pinned for
tiny models, DeepSpeed configs (ZeRO 0 with SGD, ZeRO 1/2 with Adam) and a seeded MLP trained through
``ds_dragonn.initialize``. Executed inside each rank by ``tests.multiproc.run_ranks``."""
from __future__ import annotations

import contextlib

import torch


def init_distributed():
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


#: The engine tests run a few steps of tiny models: no warm-ups (compressed from the first step, at the density
#: under test, unless a test sets warmup_steps). tests/test_selection.py covers the defaults.
PINNED = {"warmup_steps": 0, "density_warmup_steps": 0}


def pinned(dragonn: dict) -> dict:
    """:data:`PINNED` (one place for the settings every engine test shares)."""
    return PINNED


@contextlib.contextmanager
def constants_set(**values):
    """``ds_dragonn.constants`` set to ``values`` (upper-case names) inside the block, e.g. the auto policy's
    probe count; read by ``cfg.<name>`` at each call, so a hook built inside the block sees them."""
    from ds_dragonn import constants
    old = {k: getattr(constants, k) for k in values}
    for k, v in values.items():
        setattr(constants, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(constants, k, v)


def engine_config(dragonn: dict | None, bf16: bool = False, predivide: float | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
           "zero_optimization": {"stage": 0}, "steps_per_print": 10**6}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if predivide is not None:
        cfg["gradient_predivide_factor"] = predivide
    if dragonn is not None:
        cfg["dragonn"] = {"policy": "always", **pinned(dragonn), **dragonn}
    return cfg


def train_mlp(cfg: dict, rank: int, layers: tuple, steps: int):
    """A seeded MLP ``layers[0] -> layers[1] (tanh) -> layers[2]`` through ``ds_dragonn.initialize`` and
    ``steps`` micro steps of 8 random samples (the rank's own stream); returns (engine, its DRAGONN hook or None)."""
    import ds_dragonn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(layers[0], layers[1]), torch.nn.Tanh(),
                                torch.nn.Linear(layers[1], layers[2]))
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dtype = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(8, layers[0], generator=g).to(dtype)
        y = torch.randint(0, layers[2], (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
    return engine, getattr(engine, "dragonn", None)


def zero_config(stage: int, dragonn: dict | None, bf16: bool = False, gas: int = 1, **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 6000, **zero}, "steps_per_print": 10**6}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if dragonn is not None:
        cfg["dragonn"] = {"policy": "always", "min_compress_numel": 1, **pinned(dragonn), **dragonn}
    return cfg
