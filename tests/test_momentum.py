"""The momentum mode (``"compress": "momentum"``): the local momentum, the optimizer side (Adam applies the
averaged sparse momentum with its variance frozen) and the engines at ZeRO 0/1/2."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_dragonn.config import DragonnConfig, DragonnConfigError
from ds_dragonn.engine.variance import VarianceFreeze
from ds_dragonn.feedback import ErrorFeedback
from ds_dragonn.momentum import LocalMomentum
from ds_dragonn.undo import WorkingCopies
from tests.momentum_cases import BETA, ENGINE_RUNS, PIPE_CASES, PIPE_STEPS, REFRESH_RUNS, pipe_input
from tests.multiproc import ranks_fixture


def _reference(grads_per_step, beta, prescale):
    """float64: per step, the momentum M_t = β·M + (1 − β)·prescale·Σ_micro g, and the residual's increments."""
    m = None
    for micro_grads in grads_per_step:
        total = sum(micro_grads) * prescale
        m = (1 - beta) * total if m is None else beta * m + (1 - beta) * total
        yield m


@pytest.mark.parametrize("transactional", [False, True])
@pytest.mark.parametrize("micro", [1, 3])
def test_residual_grows_by_the_momentum_each_step(transactional, micro):
    """Whatever the micro steps: after step t the compensated buffer is Σ_{s<=t} M_s (float64 reference)."""
    gen = torch.Generator().manual_seed(micro)
    shapes = [(3, 4), (5,), (1,)]
    steps = [[[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(micro)]
             for _ in range(5)]
    mom, ef = LocalMomentum(0.8, transactional), ErrorFeedback(True, transactional)
    flat = [[torch.cat([t.flatten() for t in ts]) for ts in step] for step in steps]
    expected_sum = torch.zeros(18, dtype=torch.float64)
    for step, ref_m in zip(steps, _reference(flat, 0.8, 0.5)):
        for ts in step:
            tensors, pre = mom.update("b", ts, torch.float64, prescale=0.5)
            buf = ef.compensate_("b", tensors, torch.float64, pre)
        expected_sum += ref_m
        torch.testing.assert_close(buf, expected_sum, rtol=1e-13, atol=1e-13)
        mom.end_step(True)
        ef.end_step(True)
        torch.testing.assert_close(mom.momenta["b"], ref_m, rtol=1e-13, atol=1e-13)


def test_a_skipped_step_leaves_the_momentum_as_before():
    mom = LocalMomentum(0.9, transactional=True)
    g = [torch.ones(4, dtype=torch.float64)]
    mom.update("b", g, torch.float64)
    mom.end_step(True)
    before = mom.momenta["b"].clone()
    mom.update("b", [torch.full((4,), 1e6, dtype=torch.float64)], torch.float64)
    mom.end_step(False)  # DeepSpeed skipped the step (overflow)
    assert torch.equal(mom.momenta["b"], before)
    mom.update("b", g, torch.float64)
    mom.end_step(True)
    torch.testing.assert_close(mom.momenta["b"], 0.9 * before + 0.1)


def test_momentum_state_round_trip_and_errors():
    mom = LocalMomentum(0.5)
    mom.update("b", [torch.arange(6.0)], torch.float32)
    mom.end_step(True)
    other = LocalMomentum(0.5)
    other.load_state_dict(mom.state_dict())
    assert torch.equal(other.momenta["b"], mom.momenta["b"])
    mom.rescale_(4.0)
    assert torch.equal(mom.momenta["b"], other.momenta["b"] * 4)
    with pytest.raises(ValueError, match="momentum for bucket b has shape"):
        mom.update("b", [torch.ones(5)], torch.float32)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        LocalMomentum(1.0)
    mom.update("e", [torch.ones(0)], torch.float32)  # an empty bucket is fine
    # bf16 gradients: the momentum is kept in float32
    mom.update("h", [torch.ones(3, dtype=torch.bfloat16)], torch.bfloat16)
    assert mom.momenta["h"].dtype == torch.float32


@pytest.mark.parametrize("block, words", [
    ({"compress": "momentum", "advanced": {"error_feedback": False}}, "needs 'advanced.error_feedback': true"),
    ({"compress": "momentum", "warmup_steps": 0}, "'warmup_steps' >= 1"),
    ({"compress": "momentum_sgd"}, "compress"),
    ({"advanced": {"variance_refresh_steps": 1}}, "1 would refresh at every step"),
    ({"advanced": {"variance_refresh_steps": -1}}, "variance_refresh_steps"),
    ({"compress": "gradient", "advanced": {"variance_refresh_steps": 50}}, "variance_refresh_steps' applies to"),
    ({"sync": "local_steps", "advanced": {"variance_refresh_steps": 50}}, "variance_refresh_steps' applies to"),
    ({"variance_floor": 0.01}, "'dragonn.variance_floor': unknown key"),
    ({"lr_weighted_residual": False}, "'dragonn.lr_weighted_residual': unknown key"),
    ({"freeze_adam_variance": True}, "'dragonn.freeze_adam_variance': unknown key"),
    ({"variance_refresh_steps": 50}, "belongs under 'advanced'"),
])
def test_config_refuses_what_cannot_work(block, words):
    with pytest.raises(DragonnConfigError, match=words):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, **block}})
    assert DragonnConfig(enabled=True).compress.value == "auto"  # momentum for Adam-type optimizers


def _reference_momentum_adam(p0, momenta, v_warm, fraction, lr=0.01, b1=0.9, b2=0.999, eps=1e-8):
    """float64: dense Adam on ``v_warm`` gradients, then, for the elements that had gradient (V̂ > 0),
    p -= lr·(a_t/(1−β1^t))/(√V̂+eps) (V̂ floored at ``fraction`` of their mean √V̂); the other elements continue
    Adam's own update on the momenta ``a_t``."""
    p, v, m, t = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), 0
    for g in v_warm:
        t += 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    vhat = v / (1 - b2 ** t)
    root = vhat.sqrt()
    known = root > 0
    vhat = vhat.clamp_min((fraction * float(root[known].mean())) ** 2)
    for a in momenta:
        t += 1
        m = b1 * m + (1 - b1) * a
        v = b2 * v + (1 - b2) * a * a
        own = lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        p = p - torch.where(known, lr * (a / (1 - b1 ** t)) / (vhat.sqrt() + eps), own)
    return p, known


@pytest.mark.parametrize("fraction", [0.01, 0.5])
def test_adam_applies_the_averaged_momentum_with_the_frozen_variance(fraction):
    """Known elements divide the momentum by the frozen, floored variance; elements without gradient in the
    warm-up keep Adam's own update (float64 reference)."""
    p = torch.nn.Parameter(torch.randn(40, dtype=torch.float64))
    p0 = p.detach().clone()
    opt = torch.optim.Adam([p], lr=0.01)
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    freeze = VarianceFreeze(engine, freeze_step=3, fraction=fraction)
    gen = torch.Generator().manual_seed(3)
    warm = [torch.randn(40, generator=gen, dtype=torch.float64) for _ in range(3)]
    for w in warm:
        w[:5] = 0.0  # no gradient in the warm-up: no variance to divide by
    later = [torch.randn(40, generator=gen, dtype=torch.float64) * 30 for _ in range(6)]  # bursts
    for g in warm + later:
        if engine.global_steps == 3:
            freeze.arm()
        p.grad = g.clone()
        opt.step()
        engine.global_steps += 1
    ref, known = _reference_momentum_adam(p0, later, warm, fraction)
    assert not bool(known[:5].any()) and bool(known[5:].all())
    assert torch.equal(freeze.known[0], known)
    torch.testing.assert_close(p.detach(), ref, rtol=1e-10, atol=1e-12)
    assert float((p.detach() - p0)[:5].abs().max()) < 0.01 * 6 * 1.5  # Adam's own steps: ~lr each


pipe_runs = ranks_fixture("tests.momentum_cases:pipeline_runs", "mompipe", timeout=300, pool="gloo")


@pytest.mark.parametrize("ci", range(len(PIPE_CASES)), ids=[f"{x}-{n}-{d}" for x, n, d in PIPE_CASES])
def test_nothing_lost_everything_applied_plus_residuals_is_the_momenta(pipe_runs, ci):
    """Σ_t applied_t × P + all residuals (worker and server) == Σ_t Σ_ranks M_t (float64 reference)."""
    from ds_dragonn.exchange import HashedOwnership
    exchange, n, density = PIPE_CASES[ci]
    world = 2
    momenta = torch.zeros(n, dtype=torch.float64)
    for r in range(world):
        steps = [[pipe_input(ci, r, s, mi, n) for mi in range(2)] for s in range(PIPE_STEPS)]
        last = None
        for s, m in enumerate(_reference(steps, BETA, 1.0)):
            momenta += m
            last = m
        torch.testing.assert_close(pipe_runs[r][ci]["momentum"], last, rtol=1e-12, atol=1e-12)
    for r in range(world):  # every rank applied the same
        for a, b in zip(pipe_runs[0][ci]["applied"], pipe_runs[r][ci]["applied"]):
            assert torch.equal(a, b)
    applied = (sum(pipe_runs[0][ci]["applied"]) if n
               else torch.zeros(0, dtype=torch.float64))  # two reductions (micro steps) per step
    held = torch.zeros(n, dtype=torch.float64)
    own = HashedOwnership(n, world)
    for r in range(world):
        held += pipe_runs[r][ci]["residual"]
        server = pipe_runs[r][ci]["server"]
        if server is not None:
            held.index_add_(0, own.to_index(r, torch.arange(server.numel())), server)
    torch.testing.assert_close(applied * world + held, momenta, rtol=1e-11,
                               atol=1e-11 * (1 + float(momenta.abs().max()) if n else 1))
    if n > 10:
        assert float(held.abs().sum()) > 0, "a sparse run must hold something back"


engine_runs = ranks_fixture("tests.momentum_cases:engine_runs", "momengine", pool="gloo")


@pytest.mark.parametrize("name", list(ENGINE_RUNS))
def test_engines_train_in_sync_with_the_momentum_compressed(engine_runs, name):
    a, b = engine_runs[0][name], engine_runs[1][name]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert all(bool(torch.isfinite(x).all()) for x in a["params"])
    assert a["compressed"] > 0 and a["frozen"] and a["momenta"] > 0, a


@pytest.mark.parametrize("name", ["s0_fp32_d1", "s2_fp32_d1"])
def test_density_one_is_dense_adam_with_the_variance_frozen(engine_runs, name):
    """At density 1.0 nothing is delayed: the averaged local momenta are Adam's momentum, and the update is
    the dense engine's with the variance frozen after the warm-up (float rounding apart: Adam's moments are
    set differently), at ZeRO 0 and 2."""
    for r in range(2):
        ref, got = engine_runs[r]["frozen_reference"], engine_runs[r][name]["params"]
        for x, y in zip(got, ref):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(REFRESH_RUNS))
def test_engines_refresh_the_variance_without_an_update(engine_runs, name):
    """ZeRO 0 (bf16, accumulation, clipping), 1 and 2: on a refresh step (the last) the weights do not move
    (torch Adam, no weight decay), the ranks stay in sync, the step's momentum waits in the residual."""
    a, b = engine_runs[0][name], engine_runs[1][name]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert all(torch.equal(x, y) for x, y in zip(a["before"], a["params"])), "a refresh step moved the weights"
    assert a["refreshed"] == 2 and a["compressed"] > 0 and a["dense"] > 0 and a["residual"] > 0, a


def test_an_optimizer_without_betas_is_refused(engine_runs):
    for r in range(2):
        msg = engine_runs[r]["sgd_error"]
        assert msg is not None and "'dragonn.compress': 'momentum' needs Adam's update" in msg and "SGD" in msg, msg


@pytest.mark.parametrize("make, words", [
    (lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1), None),
    (lambda p: torch.optim.Adam(p, lr=0.1), None),
    (lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1), "decoupled weight decay"),
    (lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.Adam(p, lr=0.1, betas=(0.0, 0.99)), "betas[0] and betas[1] in (0, 1)"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "needs Adam's update"),
    (lambda p: torch.optim.Adamax(p, lr=0.1), "needs Adam's update"),
    (lambda p: torch.optim.NAdam(p, lr=0.1), "needs Adam's update"),
    (lambda p: torch.optim.RAdam(p, lr=0.1), "needs Adam's update"),
    (lambda p: torch.optim.Adam(p, lr=0.1, maximize=True), "maximize"),
    (lambda p: torch.optim.AdamW(p, lr=0.1, betas=(0.9, 0.0)), "betas[0] and betas[1] in (0, 1)"),
    (lambda p: torch.optim.AdamW([{"params": p[:1]}, {"params": p[1:], "betas": (0.5, 0.999)}], lr=0.1),
     "one betas[0] for every parameter group"),
])
def test_which_optimizers_the_momentum_mode_serves(make, words):
    from ds_dragonn.engine.adam import momentum_refusal
    opt = make([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))])
    why = momentum_refusal(SimpleNamespace(optimizer=SimpleNamespace(optimizer=opt)))
    assert (why is None) if words is None else (words in why and type(opt).__name__ in why), why


def test_an_optimizer_without_a_step_pre_hook_is_refused():
    from ds_dragonn.engine.adam import momentum_refusal

    class NoHooks(torch.optim.AdamW):
        register_step_pre_hook = None
    opt = NoHooks([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    assert "register_step_pre_hook" in momentum_refusal(SimpleNamespace(optimizer=opt))


def test_no_variance_to_freeze_where_beta2_is_zero():
    """torch accepts betas[1] = 0 (no variance memory): the freeze holds nothing there instead of dividing by 0."""
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.0))
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    freeze = VarianceFreeze(engine, freeze_step=1)
    freeze.arm()
    for _ in range(3):
        p.grad = torch.randn(5, dtype=torch.float64)
        opt.step()
        engine.global_steps += 1
    assert freeze.unknown() == 5 and bool(torch.isfinite(p).all())  # Adam's own update, nothing frozen


def test_parameters_that_start_training_after_the_freeze_keep_adams_own_update():
    """``b`` first gets gradient after the freeze: it keeps Adam's own update, exactly torch AdamW's on the same
    gradients (an independent reference), and the state round trip maps V̂ and the masks back by position."""
    a = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    b_ref = torch.nn.Parameter(b.detach().clone())
    opt = torch.optim.AdamW([a, b], lr=0.01, weight_decay=0.0)
    ref_opt = torch.optim.AdamW([b_ref], lr=0.01, weight_decay=0.0)
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    freeze = VarianceFreeze(engine, freeze_step=2)
    freeze.arm()
    gen = torch.Generator().manual_seed(2)
    for step in range(6):
        a.grad = torch.randn(4, generator=gen, dtype=torch.float64)
        gb = torch.randn(3, generator=gen, dtype=torch.float64) * 1000 if step >= 3 else None  # b trains from step 3
        b.grad = None if gb is None else gb.clone()
        opt.step()
        if gb is not None:
            b_ref.grad = gb.clone()
            ref_opt.step()
        engine.global_steps += 1
    torch.testing.assert_close(b.detach(), b_ref.detach(), rtol=1e-12, atol=1e-14)
    assert [tuple(p.shape) for p in freeze.params] == [(4,), (3,)] and freeze.unknown() == 3
    saved = freeze.state_dict()
    other = VarianceFreeze(engine, freeze_step=2)
    other.load_state_dict(saved)  # positions, not order of recording, map V̂ back onto the parameters
    assert [id(p) for p in other.params] == [id(a), id(b)]
    assert all(torch.equal(x, y) for x, y in zip(other.frozen, freeze.frozen))
    assert all(torch.equal(x, y) for x, y in zip(other.known, freeze.known))
    # the mask is not stored: V̂ is exactly 0 where an element has no variance, and > 0 where it has one
    assert "known" not in saved and other.unknown() == 3
    assert torch.equal(freeze.known[1], torch.zeros(3, dtype=torch.bool)) and bool((freeze.frozen[0] > 0).all())


def test_the_local_momentum_follows_a_scheduled_beta1():
    from ds_dragonn.engine.base import HookBase
    from tests.fakes import fake_engine
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.5, 0.99))
    hook = HookBase(fake_engine(optimizer=opt), DragonnConfig(enabled=True, compress="momentum", warmup_steps=1))
    assert hook.momentum.beta == 0.5
    opt.param_groups[0]["betas"] = (0.95, 0.99)  # e.g. OneCycle's cycle_momentum
    hook._follow_optimizer()  # what every reduction does first (engine/reducer.py: BucketReducer.reduce)
    assert hook.momentum.beta == 0.95
    opt.param_groups[0]["betas"] = (1.0, 0.99)  # out of range: the last valid β1 stays
    hook._follow_optimizer()
    assert hook.momentum.beta == 0.95


# -- the variance refresh (0/1 Adam's variance updates) ------------------------------------------------------

def test_the_refresh_schedule():
    from ds_dragonn.plan import density_schedule
    from ds_dragonn.schedule import DensitySchedule
    s = DensitySchedule(0.01, warmup_steps=30, density_warmup_steps=100, refresh_steps=100)
    assert [t for t in range(400) if s.refresh(t)] == [129, 229, 329]
    assert not any(DensitySchedule(0.01, 30, refresh_steps=0).refresh(t) for t in range(300))
    assert DensitySchedule(1.0, 30, refresh_steps=2).refresh(31)  # the variance is frozen at density 1.0 too
    assert not any(DensitySchedule(0.01, 30, refresh_steps=1).refresh(t) for t in range(300))  # (refused by config)
    assert [t for t in range(8) if DensitySchedule(0.1, 2, refresh_steps=2).refresh(t)] == [3, 5, 7]
    momentum = DragonnConfig(enabled=True, compress="momentum", warmup_steps=30)
    assert density_schedule(momentum).refresh_steps == 100
    gradient = DragonnConfig(enabled=True, compress="gradient", warmup_steps=30)
    assert density_schedule(gradient).refresh_steps == 0
    assert "refreshed every 100 steps" in density_schedule(momentum).describe()


def _reference_refreshed_adamw(p0, grads, freeze_at, refresh_at, rho, lr=0.01, b1=0.9, b2=0.999, eps=1e-8, wd=0.1,
                               floor=0.0):
    """float64 AdamW: dense for ``freeze_at`` steps, then the momentum mode's update with the frozen variance;
    on a step in ``refresh_at`` V̂ ← ρ·V̂ + (1 − ρ)·g² (floored) and only the weight decay."""
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)

    def floored(x):
        return x.clamp_min((floor * float(x.sqrt().mean())) ** 2) if floor else x
    vhat = None
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        if t <= freeze_at:
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            p = p - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
            continue
        if vhat is None:
            vhat = floored(v / (1 - b2 ** freeze_at))
        if t - 1 in refresh_at:
            vhat = floored(rho * vhat + (1 - rho) * g * g)
            continue
        p = p - lr * (g / (1 - b1 ** t)) / (vhat.sqrt() + eps)
    return p


@pytest.mark.parametrize("floor", [0.0, 0.01])
def test_a_refresh_moves_the_frozen_variance_and_applies_no_update(floor):
    """Against float64 AdamW: refresh steps move V̂ towards g² and only decay the weights; the steps after
    them divide by the refreshed V̂. The default ρ is max(β2^R, 0.9)."""
    p = torch.nn.Parameter(torch.randn(50, dtype=torch.float64))
    p0 = p.detach().clone()
    opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.1)
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    refresh_at = {5, 8}
    freeze = VarianceFreeze(engine, freeze_step=3, fraction=floor, refresh=lambda t: t in refresh_at, refresh_steps=3)
    rho = max(0.999 ** 3, 0.9)
    assert freeze.decay(0.999) == rho and VarianceFreeze(engine, 3, refresh_steps=100).decay(0.95) == 0.9
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(50, generator=gen, dtype=torch.float64) * (1 + 10 * (t > 5)) for t in range(10)]
    grads[1][:4] = 0.0  # awkward entries: 0 in one warm-up step, then large after the refresh
    for g in grads:
        if engine.global_steps == 3:
            freeze.arm()
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        if engine.global_steps in refresh_at:  # AdamW's decay, exactly, and nothing else
            torch.testing.assert_close(p.detach(), before * (1 - 0.01 * 0.1), rtol=0, atol=0)
        engine.global_steps += 1
    assert freeze.refreshed == 2
    ref = _reference_refreshed_adamw(p0, grads, 3, refresh_at, rho, floor=floor)
    torch.testing.assert_close(p.detach(), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("transactional", [False, True])
def test_a_refresh_step_holds_the_momentum_in_the_residual(transactional):
    """Nothing lost: after a refresh step the residual is the old residual plus this step's momentum
    (float64), the bucket owes a flush, and a skipped step leaves residual and momentum as they were."""
    from ds_dragonn.engine.base import HookBase
    from tests.fakes import fake_engine
    p = torch.nn.Parameter(torch.ones(7, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.8, 0.99))
    hook = HookBase(fake_engine(optimizer=opt), DragonnConfig(enabled=True, compress="momentum", warmup_steps=1,
                                                             advanced={"variance_refresh_steps": 2}))
    if transactional:  # (the fake engine's steps are not: working copies, as an fp16 engine's)
        hook.error_feedback.undo, hook.momentum.undo = WorkingCopies(), WorkingCopies()
    gen = torch.Generator().manual_seed(1)
    g1, g2, g3 = (torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(3))
    hook.momentum.update("b", [g1], torch.float64, 0.5)
    hook.error_feedback.compensate_("b", [hook.momentum.momenta["b"] if not transactional else hook.momentum.undo._work["b"]],
                                    torch.float64)
    for store in (hook.momentum, hook.error_feedback):
        store.end_step(True)
    m1, r1 = hook.momentum.momenta["b"].clone(), hook.error_feedback.residuals["b"].clone()
    assert hook.mode.refreshes(2) and not hook.mode.refreshes(1) and not hook.mode.refreshes(3)
    if transactional:  # a skipped refresh step: as before
        hook.mode.hold(hook, "b", [g2 * 3], torch.float64, 0.5)
        for store in (hook.momentum, hook.error_feedback):
            store.end_step(False)
        assert torch.equal(hook.momentum.momenta["b"], m1) and torch.equal(hook.error_feedback.residuals["b"], r1)
    hook.mode.hold(hook, "b", [g2, g3[:0]], torch.float64, 0.5)
    for store in (hook.momentum, hook.error_feedback):
        store.end_step(True)
    m2 = 0.8 * m1 + 0.2 * 0.5 * g2
    torch.testing.assert_close(hook.momentum.momenta["b"], m2, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(hook.error_feedback.residuals["b"], r1 + m2, rtol=1e-15, atol=1e-15)
    assert "b" in hook.pending and hook.variance_freeze.armed


def _adamw_run(freeze, engine, opt, params, grads_of, steps, arm_at):
    """Train ``steps`` optimizer steps; ``grads_of(step)`` gives each parameter's gradient (None: no grad).
    Returns each step's parameter values after it."""
    after = []
    for step in range(steps):
        if step == arm_at:
            freeze.arm()
        for p, g in zip(params, grads_of(step)):
            p.grad = None if g is None else g.clone()
        opt.step()
        engine.global_steps += 1
        after.append([p.detach().clone() for p in params])
    return after


def test_a_late_parameter_joins_at_a_refresh_where_momentum_arrived_for_it():
    """Frozen at step 2, refresh at steps 4 and 7; ``b`` trains from step 4 (the first refresh) on. On the first
    refresh it has no Adam state (nothing arrived): it does not move and stays unknown; then Adam's own update
    (torch AdamW's on the same gradients, zero on the refresh step); at the second refresh its V̂ becomes
    max(g², Adam's own bias-corrected variance), and the next step divides by it (float64)."""
    a = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    b_ref = torch.nn.Parameter(b.detach().clone())
    opt = torch.optim.AdamW([a, b], lr=0.01, weight_decay=0.0)
    ref_opt = torch.optim.AdamW([b_ref], lr=0.01, weight_decay=0.0)
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    freeze = VarianceFreeze(engine, freeze_step=2, refresh=lambda t: t in (4, 7), refresh_steps=3)
    gen = torch.Generator().manual_seed(9)
    grads = [[torch.randn(6, generator=gen, dtype=torch.float64),
              torch.randn(5, generator=gen, dtype=torch.float64) if t >= 4 else None] for t in range(9)]
    b0 = b.detach().clone()
    after = _adamw_run(freeze, engine, opt, [a, b], lambda t: grads[t], 9, arm_at=2)
    assert torch.equal(after[4][1], b0) and torch.equal(after[4][0], after[3][0])  # the refresh step: no update
    for t in (4, 5, 6):  # Adam's own update (the refresh step's gradient is zero)
        b_ref.grad = torch.zeros(5, dtype=torch.float64) if t == 4 else grads[t][1].clone()
        ref_opt.step()
        torch.testing.assert_close(after[t][1], b_ref.detach(), rtol=1e-12, atol=1e-14)
    i = freeze._index[id(b)]
    st = ref_opt.state[b_ref]
    own = st["exp_avg_sq"] / (1 - 0.999 ** float(st["step"]))
    torch.testing.assert_close(freeze.frozen[i], torch.maximum(grads[7][1] ** 2, own), rtol=1e-12, atol=0)
    assert bool(freeze.known[i].all()) and torch.equal(after[7][1], after[6][1])
    t = float(opt.state[b]["step"])  # the step after the second refresh divides by V̂
    expect = after[7][1] - 0.01 * (grads[8][1] / (1 - 0.9 ** t)) / (freeze.frozen[i].sqrt() + 1e-8)
    torch.testing.assert_close(after[8][1], expect, rtol=1e-10, atol=1e-12)


def test_without_adam_state_at_the_freeze_a_refresh_freezes_one():
    """A warm start without optimizer state (armed past the freeze step, Adam has nothing yet): Adam's own
    steps until the refresh, which sets V̂ = max(g², Adam's own variance) and moves nothing; the hook stays on."""
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.0)
    engine = SimpleNamespace(optimizer=opt, global_steps=10)
    freeze = VarianceFreeze(engine, freeze_step=2, refresh=lambda t: t == 12, refresh_steps=5)
    gen = torch.Generator().manual_seed(4)
    grads = [[torch.randn(8, generator=gen, dtype=torch.float64)] for _ in range(4)]
    p0 = p.detach().clone()
    after = _adamw_run(freeze, engine, opt, [p], lambda t: grads[t], 4, arm_at=0)
    assert freeze.active and freeze.unknown() == 0
    assert not torch.equal(after[0][0], p0)  # Adam's own step (no variance to freeze yet)
    assert torch.equal(after[2][0], after[1][0])  # step 12: the refresh, no update
    v = 0.001 * 0.999 * grads[0][0] ** 2 + 0.001 * grads[1][0] ** 2
    torch.testing.assert_close(freeze.frozen[0], torch.maximum(grads[2][0] ** 2, v / (1 - 0.999 ** 2)),
                               rtol=1e-12, atol=0)


def test_no_refresh_without_the_optimizer_pre_hook():
    """Where nothing would zero the refresh step's update (the pre-hook is gone), no step is a refresh step."""
    from ds_dragonn.engine.base import HookBase
    from tests.fakes import fake_engine
    p = torch.nn.Parameter(torch.ones(3))
    hook = HookBase(fake_engine(optimizer=torch.optim.AdamW([p], lr=0.1)),
                    DragonnConfig(enabled=True, compress="momentum", warmup_steps=1, advanced={"variance_refresh_steps": 2}))
    assert hook.mode.refreshes(2)
    hook.variance_freeze.handle.remove()
    hook.variance_freeze.handle = None
    assert not hook.mode.refreshes(2)


def test_a_changed_refresh_setting_is_reported_on_load():
    from ds_dragonn.engine.state import compare
    now = {"world_size": 2, "rank": 0, "bucketing": {}, "parameters": [], "exchange": "allgather",
           "dragonn": DragonnConfig(enabled=True, advanced={"variance_refresh_steps": 50}).model_dump(mode="json")}
    saved = {**now, "dragonn": DragonnConfig(enabled=True).model_dump(mode="json")}
    _, _, kept = compare(saved, now)
    assert any("dragonn.variance_refresh_steps 100 (now 50)" in k for k in kept), kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("transactional", [False, True])
def test_the_momentum_decodes_into_the_gradients_bit_identically(dtype, micro, transactional):
    """The momentum mode decoded straight into the gradients (no decode buffer) equals the decode buffer, bit
    for bit, with micro steps (later reductions zero the gradients in the compensation, the first in the
    momentum's update), and the momenta and residuals match."""
    from ds_dragonn.compress import DragonnCompressor
    from ds_dragonn.pipeline import CompressedAllreduce
    from tests.test_policy import LocalBackend

    def pipe():
        return CompressedAllreduce(DragonnCompressor(0.05), LocalBackend(), ErrorFeedback(True, transactional),
                                   target=LocalMomentum(0.9, transactional))

    a, b = pipe(), pipe()
    gen = torch.Generator().manual_seed(micro)
    shapes = [(40, 50), (50,), (7, 3)]
    assert b.can_reduce_into([torch.zeros(s, dtype=dtype) for s in shapes], dtype)
    for step in range(4):
        for _ in range(micro):
            grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
            into = [g.clone() for g in grads]
            out, _ = a.reduce(grads, "b", step, 0.5, 0.25, dtype)
            none, _ = b.reduce(into, "b", step, 0.5, 0.25, dtype, into_inputs=True)
            assert none is None
            assert torch.equal(torch.cat([t.flatten() for t in into]), out)
        for p in (a, b):
            p.error_feedback.end_step(True)
            p.target.end_step(True)
    assert torch.equal(a.target.momenta["b"], b.target.momenta["b"])
    assert torch.equal(a.error_feedback.residuals["b"], b.error_feedback.residuals["b"])
