"""Adam's variance frozen after the dense warm-up (engine/adam.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_dragonn.config import DragonnConfig
from ds_dragonn.engine.adam import VarianceFreeze, base_optimizer
from ds_dragonn.engine.base import HookBase
from tests.fakes import fake_engine


def _engine(opt_cls=torch.optim.AdamW, wrapped: int = 0, **kw):
    p = torch.nn.Parameter(torch.randn(50, dtype=torch.float64))
    opt = opt_cls([p], lr=0.01, **kw)
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


def _reference_frozen_adam(p0, grads, freeze_at, lr=0.01, b1=0.9, b2=0.999, eps=1e-8):
    """float64 Adam whose bias-corrected variance is fixed at its value before step ``freeze_at + 1``."""
    p, m, v, vhat_frozen = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), None
    for t, g in enumerate(grads, start=1):
        if t > freeze_at and vhat_frozen is None:
            vhat_frozen = v / (1 - b2 ** (t - 1))
        m = b1 * m + (1 - b1) * g
        if vhat_frozen is None:
            v = b2 * v + (1 - b2) * g * g
            vhat = v / (1 - b2 ** t)
        else:
            vhat = vhat_frozen
        p = p - lr * (m / (1 - b1 ** t)) / (vhat.sqrt() + eps)
    return p


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_frozen_run_equals_adam_with_a_fixed_preconditioner(opt_cls):
    """Against an independent float64 reference: a burst after the freeze is applied linearly (not divided by
    its own square), and the effective step does not drift with the bias correction."""
    kw = {"weight_decay": 0.0} if opt_cls is torch.optim.AdamW else {}
    engine, opt, p = _engine(opt_cls, **kw)
    p0 = p.detach().clone()
    freeze = VarianceFreeze(engine, freeze_step=3)
    freeze.arm()
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(40)]
    grads[20] = grads[20] * 100.0  # a burst, as error feedback delivers one
    for g in grads:
        _step(engine, opt, p, g)
    ref = _reference_frozen_adam(p0, grads, freeze_at=3)
    assert torch.allclose(p.detach(), ref, rtol=1e-9, atol=1e-12)
    unfrozen = _reference_frozen_adam(p0, grads, freeze_at=10**9)
    assert not torch.allclose(p.detach(), unfrozen, rtol=1e-3)  # the freeze changed the run


def test_nothing_is_frozen_before_a_compressed_step():
    engine, opt, p = _engine()
    freeze = VarianceFreeze(engine, freeze_step=0)
    for _ in range(3):
        _step(engine, opt, p, torch.randn(50, dtype=torch.float64))
        assert freeze.frozen is None  # never armed: every bucket went dense
    freeze.arm()
    _step(engine, opt, p, torch.randn(50, dtype=torch.float64))
    assert freeze.frozen is not None


def test_nothing_to_freeze_without_a_variance():
    engine, opt, p = _engine(torch.optim.SGD)
    freeze = VarianceFreeze(engine, freeze_step=0)
    freeze.arm()
    _step(engine, opt, p, torch.ones(50, dtype=torch.float64))
    assert not freeze.active and freeze.frozen is None


def test_resume_records_the_same_frozen_variance():
    """A load replaces the state; the next step records V̂ from it: a resumed run equals the uninterrupted one."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(12)]
    engine, opt, p = _engine()
    freeze = VarianceFreeze(engine, 2)
    freeze.arm()
    for g in grads[:6]:
        _step(engine, opt, p, g)
    saved = ({k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}, p.detach().clone())
    for g in grads[6:]:
        _step(engine, opt, p, g)
    engine2, opt2, p2 = _engine()
    with torch.no_grad():
        p2.copy_(saved[1])
    opt2.state[p2] = {k: v.clone() if torch.is_tensor(v) else v for k, v in saved[0].items()}
    engine2.global_steps = 6
    freeze2 = VarianceFreeze(engine2, 2)
    freeze2.arm()
    freeze2.reset()
    for g in grads[6:]:
        _step(engine2, opt2, p2, g)
    assert torch.allclose(p2.detach(), p.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("block, active", [
    ({"warmup_steps": 5, "freeze_adam_variance": True}, True),
    ({"warmup_steps": 0, "freeze_adam_variance": True}, False),  # no dense steps to estimate the variance from
    ({"warmup_steps": 5, "freeze_adam_variance": True, "density": 1.0}, False),  # nothing delayed
    ({"warmup_steps": 5, "freeze_adam_variance": True, "error_feedback": False}, False),
    ({"warmup_steps": 5}, False),  # off by default
])
def test_hook_freezes_only_where_gradients_arrive_in_bursts(block, active):
    p = torch.nn.Parameter(torch.randn(4))
    engine = fake_engine(optimizer=torch.optim.Adam([p]))
    hook = HookBase(engine, DragonnConfig(enabled=True, **block))
    assert (hook.variance_freeze is not None) == active
