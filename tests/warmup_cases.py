"""Rank functions for tests/test_warmup.py: the online ``"warmup_steps": "auto"`` (no scheduler in the engine;
the training loop sets the learning rate, as a framework stepping its own schedule does) across a checkpoint
resumed on more ranks than saved it, and an optimizer whose learning rate is None."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.engines import engine_config, init_distributed

PEAK, RISE = 0.01, 25  # the learning rate rises for 25 steps: the dense warm-up ends at step 50


def _config() -> dict:
    cfg = engine_config({"enabled": True, "density": 0.05, "min_compress_numel": 1})
    del cfg["dragonn"]["warmup_steps"]  # the default, "auto"
    return cfg


def _engine(optimizer=None):
    import ds_dragonn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    cfg = _config()
    if optimizer is not None:
        cfg.pop("optimizer")
        optimizer = optimizer(model.parameters())
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                       optimizer=optimizer)
    return engine


def _train(engine, steps: int, rank: int, set_lr: bool = True) -> list:
    """``steps`` steps; returns the steps whose reduction was compressed."""
    g = torch.Generator().manual_seed(rank + 100 * int(engine.global_steps))
    compressed = []
    for _ in range(steps):
        step = int(engine.global_steps)
        if set_lr:
            for group in engine.optimizer.param_groups:
                group["lr"] = PEAK * min(1.0, step / RISE)
        before = engine.dragonn.telemetry.compressed_reductions
        engine.backward(engine(torch.randn(8, 32, generator=g)).square().mean())
        engine.step()
        if engine.dragonn.telemetry.compressed_reductions > before:
            compressed.append(step)
    return compressed


def save_mid_warmup(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    engine = _engine()
    _train(engine, 40, rank)
    engine.save_checkpoint(str(Path(out_dir) / "ckpt"), tag="s40")


class _RelativeSteps(torch.optim.Optimizer):
    """Parameter groups whose ``lr`` is None (as transformers' Adafactor with relative steps)."""

    def __init__(self, params):
        super().__init__(params, {"lr": None})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.01)


def resume_on_more_ranks(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    engine = _engine()
    engine.load_checkpoint(str(Path(out_dir) / "ckpt"), tag="s40")
    compressed = _train(engine, 20, rank)
    none_lr = _engine(optimizer=_RelativeSteps)
    _train(none_lr, 3, rank, set_lr=False)
    out = {"tracker": engine.dragonn.warmup_tracker.state_dict(), "schedule": engine.dragonn.schedule.warmup_steps,
           "first_compressed": compressed[0] if compressed else None, "none_lr_steps": int(none_lr.global_steps)}
    (Path(out_dir) / f"grow_{rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()
