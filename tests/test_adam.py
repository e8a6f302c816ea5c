"""Adam's variance frozen after the dense warm-up (engine/adam.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_dragonn.config import DragonnConfig
from ds_dragonn.engine.adam import VarianceFreeze, base_optimizer
from ds_dragonn.engine.base import HookBase
from tests.fakes import fake_engine


def _engine(opt_cls=torch.optim.AdamW, wrapped: int = 0):
    p = torch.nn.Parameter(torch.randn(50))
    opt = opt_cls([p], lr=0.01)
    outer = opt
    for _ in range(wrapped):  # DeepSpeed's BF16/FP16/ZeRO optimizers hold the torch one in .optimizer
        outer = SimpleNamespace(optimizer=outer)
    return SimpleNamespace(optimizer=outer, global_steps=0), opt, p


def _step(engine, opt, p, g):
    p.grad = g.clone()
    opt.step()
    engine.global_steps += 1


@pytest.mark.parametrize("wrapped", [0, 1, 2])
def test_base_optimizer_is_found_through_wrappers(wrapped):
    engine, opt, _ = _engine(wrapped=wrapped)
    assert base_optimizer(engine) is opt


def test_variance_is_frozen_from_the_freeze_step():
    engine, opt, p = _engine()
    freeze = VarianceFreeze(engine, freeze_step=3)
    gen = torch.Generator().manual_seed(0)
    seen = []
    for _ in range(8):
        _step(engine, opt, p, torch.randn(50, generator=gen))
        seen.append(opt.state[p]["exp_avg_sq"].clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[2], seen[3])  # steps 1-3 update it
    assert all(torch.equal(seen[3], s) for s in seen[4:])  # the step ending global step 4 froze it
    # the snapshot is the variance right after the freeze step
    assert freeze.frozen is not None and torch.equal(freeze.frozen[0], seen[3])


def test_nothing_to_freeze_without_a_variance():
    engine, opt, p = _engine(torch.optim.SGD)
    freeze = VarianceFreeze(engine, freeze_step=0)
    _step(engine, opt, p, torch.ones(50))
    assert not freeze.active and freeze.frozen is None


def test_reset_takes_a_new_snapshot():
    engine, opt, p = _engine()
    freeze = VarianceFreeze(engine, freeze_step=1)
    for _ in range(3):
        _step(engine, opt, p, torch.randn(50))
    opt.state[p]["exp_avg_sq"] = opt.state[p]["exp_avg_sq"] * 4  # a load replaces the state tensors
    freeze.reset()
    _step(engine, opt, p, torch.randn(50))
    v = opt.state[p]["exp_avg_sq"].clone()
    _step(engine, opt, p, torch.randn(50))
    assert torch.equal(opt.state[p]["exp_avg_sq"], v)


@pytest.mark.parametrize("block, active", [
    ({"warmup_steps": 5}, True),
    ({"warmup_steps": 0}, False),  # no dense steps to estimate the variance from
    ({"warmup_steps": 5, "density": 1.0}, False),  # nothing delayed
    ({"warmup_steps": 5, "error_feedback": False}, False),
    ({"warmup_steps": 5, "freeze_adam_variance": False}, False),
])
def test_hook_freezes_only_where_gradients_arrive_in_bursts(block, active):
    p = torch.nn.Parameter(torch.randn(4))
    engine = fake_engine(optimizer=torch.optim.Adam([p]))
    hook = HookBase(engine, DragonnConfig(enabled=True, **block))
    assert (hook.variance_freeze is not None) == active
