"""The optimizer side of the momentum mode: finding the optimizer (engine/adam.py) and the variance freeze's
life cycle (engine/variance.py; its arithmetic is tested in tests/test_momentum.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_dragonn.config import DragonnConfig
from ds_dragonn.engine.adam import base_optimizer
from ds_dragonn.engine.variance import VarianceFreeze
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
    """A load restores the saved V̂ and masks (not recomputed from ``exp_avg_sq``, which the momentum mode leaves
    off target): a resumed run equals the uninterrupted one."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(12)]
    engine, opt, p = _engine()
    freeze = VarianceFreeze(engine, 2)
    freeze.arm()
    for g in grads[:6]:
        _step(engine, opt, p, g)
    saved = ({k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}, p.detach().clone(),
             freeze.state_dict())
    for g in grads[6:]:
        _step(engine, opt, p, g)
    engine2, opt2, p2 = _engine()
    with torch.no_grad():
        p2.copy_(saved[1])
    opt2.state[p2] = {k: v.clone() if torch.is_tensor(v) else v for k, v in saved[0].items()}
    engine2.global_steps = 6
    freeze2 = VarianceFreeze(engine2, 2)
    freeze2.load_state_dict(saved[2])
    assert freeze2.armed and freeze2.frozen is not None
    for g in grads[6:]:
        _step(engine2, opt2, p2, g)
    assert torch.allclose(p2.detach(), p.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("block, active", [
    ({"warmup_steps": 5, "compress": "momentum"}, True),
    ({"warmup_steps": 5, "compress": "gradient"}, False),  # the gradient mode runs Adam unchanged
])
def test_hook_freezes_only_in_the_momentum_mode(block, active):
    p = torch.nn.Parameter(torch.randn(4))
    engine = fake_engine(optimizer=torch.optim.Adam([p]))
    hook = HookBase(engine, DragonnConfig(enabled=True, **block))
    assert (hook.variance_freeze is not None) == active


class FusedAdam(torch.optim.Optimizer):
    """DeepSpeed's FusedAdam as it counts steps (deepspeed/ops/adam/fused_adam.py, 0.19.8): a new state starts at
    the group's count (0), only the last parameter's ``state["step"]`` is incremented, and that count is the bias
    correction of the whole group (checked against the real one: ``[0, 0, 3]`` after 3 steps of 3 tensors)."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, bias_correction=True))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            for p in ps:
                if not self.state[p]:
                    self.state[p].update(step=group.get("step", 0), exp_avg=torch.zeros_like(p),
                                         exp_avg_sq=torch.zeros_like(p))
            if not ps:
                continue
            self.state[ps[-1]]["step"] += 1
            t = self.state[ps[-1]]["step"]
            (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
            for p in ps:
                m, v = self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.addcdiv_(m / (1 - b1 ** t), (v / (1 - b2 ** t)).sqrt().add_(eps), value=-lr)


def test_fused_adams_shared_step_count_freezes_every_tensor():
    """FusedAdam leaves every count but the last tensor's at 0: the freeze reads the group's count, so every
    tensor with gradient gets its variance frozen (bias-corrected with the count the kernel used), none keeps
    Adam's own update."""
    a, b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64)), torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    opt = FusedAdam([a, b], betas=(0.9, 0.99))
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    freeze = VarianceFreeze(engine, freeze_step=3)
    freeze.arm()
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p in (a, b):
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        opt.step()
        engine.global_steps += 1
    assert [opt.state[p]["step"] for p in (a, b)] == [0, 3]  # as DeepSpeed's
    for p in (a, b):
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    opt.step()  # the freeze records V̂ before this step
    assert [tuple(p.shape) for p in freeze.params] == [(4,), (3,)] and freeze.unknown() == 0
    # the momentum step sets Adam's moments so that its update divides by the frozen V̂, whose count is 3
    assert [tuple(v.shape) for v in freeze.frozen] == [(4,), (3,)]


@pytest.mark.parametrize("beta2", [0.999, 0.95, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adams_decay_lands_on_the_frozen_variance(beta2, dtype):
    """``before_decay``: Adam's ``v·β2`` puts the frozen ``V̂`` back, exactly for all but the values just below a
    power of two, which land 1 ulp away (so ``V̂`` can move once, by 1 ulp, never drift)."""
    from ds_dragonn.engine.variance_math import before_decay
    gen = torch.Generator().manual_seed(1)
    vhat = torch.exp(torch.randn(200_000, generator=gen, dtype=torch.float64) * 20).to(dtype)
    vhat = torch.cat([vhat, torch.tensor([1.0, 2.0 ** -30, 1e-38, 3e38], dtype=dtype) * beta2 ** 0.5])
    huge = torch.finfo(dtype).max * beta2
    assert torch.equal(before_decay(vhat[vhat > huge], beta2), vhat[vhat > huge])  # no inf: decays once instead
    vhat = vhat[vhat <= huge]
    back = before_decay(vhat, beta2) * beta2
    mantissa, _ = torch.frexp(vhat)  # in [0.5, 1)
    band = mantissa >= beta2  # V̂ in [β2·2^e, 2^e): products of consecutive values 2 ulps apart
    assert torch.equal(back[~band], vhat[~band]) and bool(band.any())
    ulp = torch.nextafter(vhat, torch.full_like(vhat, float("inf"))) - vhat
    assert bool(((back - vhat).abs() <= ulp).all())
    assert torch.equal(before_decay(back, beta2) * beta2, back)  # a value it landed on is kept exactly


@pytest.mark.parametrize("foreach", [False, True])
def test_the_frozen_variance_stays_in_adams_state_through_adamw_steps(foreach):
    """fp32 AdamW (its single-tensor and foreach kernels): after the freeze ``exp_avg_sq`` holds V̂ at the known
    elements and ``exp_avg`` 0, step after step (no drift), and each step applies lr·(g/c1)/(√V̂ + eps) after AdamW's
    decay, as the float64 formula gives."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, foreach=foreach)
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    freeze = VarianceFreeze(engine, freeze_step=3)
    for t in range(3):
        p.grad = torch.randn(1000)
        p.grad[:10] = 0.0  # no variance: Adam's own update
        opt.step()
        engine.global_steps += 1
    freeze.arm()
    frozen = None
    for t in range(3, 12):
        g = torch.randn(1000) * 5
        before = p.detach().double().clone()
        p.grad = g.clone()
        opt.step()
        engine.global_steps += 1
        state = opt.state[p]
        known = freeze.known[0]
        assert not bool(known[:10].any()) and bool(known[10:].all())
        if frozen is None:
            frozen = state["exp_avg_sq"].clone()
        assert torch.equal(state["exp_avg_sq"][10:], frozen[10:]) and not bool(state["exp_avg"][10:].any())
        c1 = 1 - 0.9 ** (t + 1)
        want = before * (1 - 1e-3 * 0.1) - 1e-3 * (g.double() / c1) / (frozen.double().sqrt() + 1e-8)
        torch.testing.assert_close(p.detach().double()[10:], want[10:], rtol=0, atol=1e-6)


def test_a_reset_freeze_keeps_the_frozen_variance_it_finds():
    """A load that resets the freeze (warm start, missing DRAGONN files) while Adam's state holds V̂ already: the
    next record keeps V̂ as it is, not divided by 1 − β2^t a second time; a raw element (exp_avg ≠ 0) is recorded."""
    p = torch.nn.Parameter(torch.randn(50))
    opt = torch.optim.AdamW([p], lr=1e-3)
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    freeze = VarianceFreeze(engine, freeze_step=3)
    for t in range(6):
        if t == 3:
            freeze.arm()
        p.grad = torch.randn(50)
        opt.step()
        engine.global_steps += 1
    vhat = opt.state[p]["exp_avg_sq"].clone()
    assert bool(freeze.known[0].all())
    opt.state[p]["exp_avg"][:5] = 0.5  # five elements back on Adam's own update (a raw v)
    raw = opt.state[p]["exp_avg_sq"][:5].clone()
    freeze.reset()
    p.grad = torch.zeros(50)
    opt.step()
    state = opt.state[p]
    assert torch.equal(state["exp_avg_sq"][5:], vhat[5:])
    torch.testing.assert_close(state["exp_avg_sq"][:5], raw / (1 - 0.999 ** 6), rtol=1e-6, atol=0)
    assert bool(freeze.known[0].all())


@pytest.mark.parametrize("n", [1, 7, 1000, 4097])
def test_the_freeze_works_chunk_by_chunk_as_on_the_whole_tensor(n):
    """The pre-hook's elementwise work runs chunk by chunk (its temporaries: a few copies of a chunk, not of the
    tensor): the record, a momentum step and a refresh with 7-element chunks equal the same on one chunk, a
    partly known tensor included (exactly; the floor's mean to its float64 rounding)."""
    from ds_dragonn.engine import variance_math as vm

    def run(chunk):
        gen = torch.Generator().manual_seed(n)
        p = torch.randn(n, generator=gen)
        state = {"exp_avg": torch.randn(n, generator=gen), "exp_avg_sq": torch.rand(n, generator=gen) ** 4}
        state["exp_avg_sq"][::3] = 0.0  # no variance: not known
        quiet = vm.record_(state, 0.3, chunk=chunk)
        g = torch.randn(n, generator=gen) * 10
        vm.momentum_step_(p, state, g, False, 0.999, 0.5, 1e-3, 1e-8, 0.99, chunk=chunk)
        state["exp_avg"][1::3] = 0.25  # back on Adam's own update: joins at the refresh
        joined = vm.refresh_(state, torch.randn(n, generator=gen), 0.999, 0.2, 0.9, chunk=chunk)
        return p, g, state, quiet, joined

    whole, chunked = run(vm.CHUNK), run(7)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert whole[3:] == chunked[3:] and whole[3] == len(range(0, n, 3))
    torch.testing.assert_close(chunked[2]["exp_avg_sq"], whole[2]["exp_avg_sq"], rtol=1e-12, atol=0)
    assert torch.equal(chunked[2]["exp_avg"], whole[2]["exp_avg"])
