"""The momentum mode (``"compress": "momentum"``): the local momentum, the optimizer side (Adam applies the
averaged sparse momentum with its variance frozen) and the engines at ZeRO 0/1/2."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_dragonn.config import DragonnConfig, DragonnConfigError
from ds_dragonn.engine.adam import VarianceFreeze
from ds_dragonn.feedback import ErrorFeedback
from ds_dragonn.momentum import LocalMomentum
from tests.momentum_cases import BETA, ENGINE_RUNS, PIPE_CASES, PIPE_STEPS, REFRESH_RUNS, pipe_input, pipe_weight
from tests.multiproc import load_rank_files, run_ranks


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


def test_the_lr_weighted_residual_grows_by_each_steps_weighted_momentum():
    """w_t = lr_t / lr_ref (lr_ref: the first positive lr), the residual gets Σ w_t·M_t (float64), the momentum
    itself is unweighted, and the reference survives a state round trip."""
    gen = torch.Generator().manual_seed(5)
    lrs = [0.0, 0.2, 0.4, 0.0, 0.1, 1.0]  # a warm-up from 0, a step at 0
    grads = [[torch.randn(7, generator=gen, dtype=torch.float64)] for _ in lrs]
    mom, ef = LocalMomentum(0.9, lr_weighted=True), ErrorFeedback(True)
    expected = torch.zeros(7, dtype=torch.float64)
    for lr, g, ref_m in zip(lrs, grads, _reference([[x[0]] for x in grads], 0.9, 1.0)):
        w = mom.follow_lr(lr)
        assert w == (lr / 0.2 if mom.reference_lr else 1.0)
        assert mom.unweighted(0.5) == (0.5 / w if w else 0.0)  # handed out in this step's units; 0 at lr 0
        tensors, pre = mom.update("b", g, torch.float64)
        buf = ef.compensate_("b", tensors, torch.float64, pre)
        expected += w * ref_m
        torch.testing.assert_close(buf, expected, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(mom.momenta["b"], ref_m, rtol=1e-13, atol=1e-13)
        mom.end_step(True)
        ef.end_step(True)
    assert mom.reference_lr == 0.2
    other = LocalMomentum(0.9, lr_weighted=True)
    other.load_state_dict(mom.state_dict())
    assert other.reference_lr == 0.2 and other.follow_lr(0.05) == 0.25
    other.load_state_dict({"momenta": {}})  # saved before the weighting existed: the next lr is the reference
    assert other.reference_lr is None and other.follow_lr(0.3) == 1.0
    plain = LocalMomentum(0.9)  # lr_weighted_residual false: always 1
    assert plain.follow_lr(0.5) == 1.0 and plain.follow_lr(0.0) == 1.0 and plain.reference_lr is None
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="learning rate must be finite and >= 0"):
            mom.follow_lr(bad)


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
    ({"compress": "momentum", "error_feedback": False}, "needs 'error_feedback': true"),
    ({"compress": "momentum", "warmup_steps": 0}, "'warmup_steps' >= 1"),
    ({"compress": "momentum_sgd"}, "compress"),
    ({"variance_floor": -0.1}, "variance_floor"),
    ({"variance_floor": 2}, "variance_floor"),
    ({"variance_refresh_steps": 1}, "'variance_refresh_steps': 1 would refresh at every step"),
    ({"variance_refresh_steps": -1}, "variance_refresh_steps"),
    ({"compress": "gradient", "variance_refresh_steps": 50}, "'variance_refresh_steps' applies to 'compress': 'momentum'"),
    ({"compress": "gradient", "variance_refresh_decay": 0.5}, "'variance_refresh_decay' applies to"),
    ({"compress": "gradient", "lr_weighted_residual": False}, "'lr_weighted_residual' applies to"),
    ({"lr_weighted_residual": 1}, "lr_weighted_residual"),
    ({"sync": "local_steps", "lr_weighted_residual": True}, "'lr_weighted_residual' applies to 'sync': 'every_step'"),
    ({"variance_refresh_steps": 0, "variance_refresh_decay": 0.9}, "'variance_refresh_decay' has no effect"),
    ({"compress": "gradient", "variance_refresh_steps": 1}, "'variance_refresh_steps' applies to 'compress'"),
    ({"variance_refresh_decay": 1.0}, "variance_refresh_decay"),
    ({"variance_refresh_decay": 0.0}, "variance_refresh_decay"),  # V̂ = 0 where one step's gradient is 0
    ({"variance_refresh_decay": 0.49}, "variance_refresh_decay"),
    ({"sync": "local_steps", "variance_refresh_steps": 50}, "'variance_refresh_steps' applies to 'sync': 'every_step'"),
])
def test_config_refuses_what_cannot_work(block, words):
    with pytest.raises(DragonnConfigError, match=words):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, **block}})
    assert DragonnConfig(enabled=True).compress.value == "auto"  # momentum for Adam-type optimizers


def _reference_momentum_adam(p0, momenta, freeze_at, v_warm, lr=0.01, b1=0.9, b2=0.999, eps=1e-8, floor=0.0):
    """float64: dense Adam for ``freeze_at`` steps on ``v_warm`` gradients, then p -= lr·(a_t/(1−β1^t))/(√V̂+eps)
    with V̂ the (floored) bias-corrected variance after the warm-up and a_t the given momenta."""
    p, v = p0.clone(), torch.zeros_like(p0)
    m = torch.zeros_like(p0)
    t = 0
    for g in v_warm:
        t += 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    vhat = v / (1 - b2 ** t)
    if floor:
        vhat = vhat.clamp_min((floor * float(vhat.sqrt().mean())) ** 2)
    for a in momenta:
        t += 1
        p = p - lr * (a / (1 - b1 ** t)) / (vhat.sqrt() + eps)
    return p


@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_adam_applies_the_averaged_momentum_with_the_frozen_floored_variance(floor):
    p = torch.nn.Parameter(torch.randn(40, dtype=torch.float64))
    p0 = p.detach().clone()
    opt = torch.optim.Adam([p], lr=0.01)
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    freeze = VarianceFreeze(engine, freeze_step=3, floor=floor, momentum=True)
    gen = torch.Generator().manual_seed(3)
    warm = [torch.randn(40, generator=gen, dtype=torch.float64) for _ in range(3)]
    warm[0][:5] = 0.0  # quiet in the warm-up: the floor bounds their later steps
    warm[1][:5] = 0.0
    warm[2][:5] = 0.0
    later = [torch.randn(40, generator=gen, dtype=torch.float64) * 30 for _ in range(6)]  # bursts
    for g in warm + later:
        if engine.global_steps == 3:
            freeze.arm()
        p.grad = g.clone()
        opt.step()
        engine.global_steps += 1
    ref = _reference_momentum_adam(p0, later, 3, warm, floor=floor)
    torch.testing.assert_close(p.detach(), ref, rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def pipe_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("mompipe")
    run_ranks("tests.momentum_cases:pipeline_runs", 2, out, timeout=300)
    return load_rank_files(out, "mompipe", 2)


@pytest.mark.parametrize("ci", range(len(PIPE_CASES)), ids=[f"{x}-{n}-{d}" for x, n, d in PIPE_CASES])
def test_nothing_lost_everything_applied_plus_residuals_is_the_momenta(pipe_runs, ci):
    """Σ_t w_t × applied_t × P + all residuals (worker and server) == Σ_t w_t × Σ_ranks M_t (float64 reference;
    the residual is learning-rate weighted: what is handed out is in each step's own units)."""
    from ds_dragonn.exchange import HashedOwnership
    exchange, n, density = PIPE_CASES[ci]
    world = 2
    momenta = torch.zeros(n, dtype=torch.float64)
    for r in range(world):
        steps = [[pipe_input(ci, r, s, mi, n) for mi in range(2)] for s in range(PIPE_STEPS)]
        last = None
        for s, m in enumerate(_reference(steps, BETA, 1.0)):
            momenta += pipe_weight(s) * m
            last = m
        torch.testing.assert_close(pipe_runs[r][ci]["momentum"], last, rtol=1e-12, atol=1e-12)
    for r in range(world):  # every rank applied the same
        for a, b in zip(pipe_runs[0][ci]["applied"], pipe_runs[r][ci]["applied"]):
            assert torch.equal(a, b)
    applied = (sum(pipe_weight(i // 2) * a for i, a in enumerate(pipe_runs[0][ci]["applied"])) if n
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


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("momengine")
    run_ranks("tests.momentum_cases:engine_runs", 2, out, timeout=400)
    return load_rank_files(out, "momengine", 2)


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
    freeze = VarianceFreeze(engine, freeze_step=1, momentum=True)
    freeze.arm()
    for _ in range(3):
        p.grad = torch.randn(5, dtype=torch.float64)
        opt.step()
        engine.global_steps += 1
    assert freeze.frozen is None and bool(torch.isfinite(p).all())


def test_parameters_that_start_training_after_the_freeze_get_their_variance_frozen_then():
    a = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    opt = torch.optim.AdamW([a, b], lr=0.01, weight_decay=0.0)
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    freeze = VarianceFreeze(engine, freeze_step=2, momentum=True)
    freeze.arm()
    for step in range(6):
        a.grad = torch.randn(4, dtype=torch.float64)
        b.grad = torch.randn(3, dtype=torch.float64) if step >= 3 else None  # b trains from step 3 on
        opt.step()
        engine.global_steps += 1
    assert [tuple(p.shape) for p in freeze.params] == [(4,), (3,)]  # b's variance frozen once it had one
    saved = freeze.state_dict()
    other = VarianceFreeze(engine, freeze_step=2, momentum=True)
    other.load_state_dict(saved)  # positions, not order of recording, map V̂ back onto the parameters
    assert [id(p) for p in other.params] == [id(a), id(b)]
    assert all(torch.equal(x, y) for x, y in zip(other.frozen, freeze.frozen))


def test_the_local_momentum_follows_a_scheduled_beta1():
    from ds_dragonn.engine.base import HookBase
    from tests.fakes import fake_engine
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.5, 0.99))
    hook = HookBase(fake_engine(optimizer=opt), DragonnConfig(enabled=True, compress="momentum", warmup_steps=1))
    assert hook.momentum.beta == 0.5
    opt.param_groups[0]["betas"] = (0.95, 0.99)  # e.g. OneCycle's cycle_momentum
    hook._follow_optimizer()  # what every reduction does first (stage0._reduce, stage_1_and_2.average_tensor)
    assert hook.momentum.beta == 0.95
    opt.param_groups[0]["betas"] = (1.0, 0.99)  # out of range: the last valid β1 stays
    hook._follow_optimizer()
    assert hook.momentum.beta == 0.95


# -- the variance refresh (0/1 Adam's variance updates) ------------------------------------------------------

def test_the_refresh_schedule():
    from ds_dragonn.schedule import DensitySchedule
    s = DensitySchedule(0.01, warmup_steps=30, density_warmup_steps=100, refresh_steps=100)
    assert [t for t in range(400) if s.refresh(t)] == [129, 229, 329]
    assert not any(DensitySchedule(0.01, 30, refresh_steps=0).refresh(t) for t in range(300))
    assert DensitySchedule(1.0, 30, refresh_steps=2).refresh(31)  # the variance is frozen at density 1.0 too
    assert not any(DensitySchedule(0.01, 30, refresh_steps=1).refresh(t) for t in range(300))  # (refused by config)
    assert [t for t in range(8) if DensitySchedule(0.1, 2, refresh_steps=2).refresh(t)] == [3, 5, 7]
    momentum = DragonnConfig(enabled=True, compress="momentum", warmup_steps=30)
    assert DensitySchedule.from_config(momentum).refresh_steps == 100
    gradient = DragonnConfig(enabled=True, compress="gradient", warmup_steps=30)
    assert DensitySchedule.from_config(gradient).refresh_steps == 0
    assert "refreshed every 100 steps" in DensitySchedule.from_config(momentum).describe()


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


@pytest.mark.parametrize("floor, decay", [(0.0, None), (0.5, 0.7)])
def test_a_refresh_moves_the_frozen_variance_and_applies_no_update(floor, decay):
    """Against float64 AdamW: refresh steps move V̂ towards g² and only decay the weights; the steps after
    them divide by the refreshed V̂. The default ρ is max(β2^R, 0.9)."""
    p = torch.nn.Parameter(torch.randn(50, dtype=torch.float64))
    p0 = p.detach().clone()
    opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.1)
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    refresh_at = {5, 8}
    freeze = VarianceFreeze(engine, freeze_step=3, floor=floor, momentum=True, refresh=lambda t: t in refresh_at,
                            refresh_steps=3, refresh_decay=decay)
    rho = decay if decay is not None else max(0.999 ** 3, 0.9)
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
                                                             variance_refresh_steps=2))
    hook.error_feedback.transactional = hook.momentum.transactional = transactional
    gen = torch.Generator().manual_seed(1)
    g1, g2, g3 = (torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(3))
    hook.momentum.update("b", [g1], torch.float64, 0.5)
    hook.error_feedback.compensate_("b", [hook.momentum.momenta["b"] if not transactional else hook.momentum._work["b"]],
                                    torch.float64)
    for store in (hook.momentum, hook.error_feedback):
        store.end_step(True)
    m1, r1 = hook.momentum.momenta["b"].clone(), hook.error_feedback.residuals["b"].clone()
    assert hook._refreshes(2) and not hook._refreshes(1) and not hook._refreshes(3)
    if transactional:  # a skipped refresh step: as before
        hook._hold_momentum("b", [g2 * 3], torch.float64, 0.5)
        for store in (hook.momentum, hook.error_feedback):
            store.end_step(False)
        assert torch.equal(hook.momentum.momenta["b"], m1) and torch.equal(hook.error_feedback.residuals["b"], r1)
    hook._hold_momentum("b", [g2, g3[:0]], torch.float64, 0.5)
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


def test_a_parameter_first_trained_on_a_refresh_step_gets_its_variance_from_it():
    """Frozen at step 2, refresh at step 4: ``b`` trains from step 4 on. It does not move on the refresh step,
    its V̂ is that step's g² (floor 0), and the next step divides by it (float64)."""
    a = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = torch.optim.AdamW([a, b], lr=0.01, weight_decay=0.0)
    engine = SimpleNamespace(optimizer=opt, global_steps=0)
    freeze = VarianceFreeze(engine, freeze_step=2, momentum=True, refresh=lambda t: t == 4, refresh_steps=3)
    gen = torch.Generator().manual_seed(9)
    grads = [[torch.randn(6, generator=gen, dtype=torch.float64),
              torch.randn(5, generator=gen, dtype=torch.float64) if t >= 4 else None] for t in range(6)]
    b0 = b.detach().clone()
    after = _adamw_run(freeze, engine, opt, [a, b], lambda t: grads[t], 6, arm_at=2)
    assert torch.equal(after[4][1], b0) and torch.equal(after[4][0], after[3][0])  # the refresh step: no update
    i = freeze._index[id(b)]
    torch.testing.assert_close(freeze.frozen[i], grads[4][1] ** 2, rtol=0, atol=0)
    t = 2.0  # b's own Adam step count at step 5 (its state was created, zero, on the refresh step)
    expect = b0 - 0.01 * (grads[5][1] / (1 - 0.9 ** t)) / (grads[4][1].abs() + 1e-8)
    torch.testing.assert_close(after[5][1], expect, rtol=1e-10, atol=1e-12)


def test_without_adam_state_at_the_freeze_the_first_refresh_freezes_one():
    """A warm start without optimizer state (armed past the freeze step, Adam has nothing yet): Adam's own
    steps until the refresh, which sets every V̂ from its g² and moves nothing; the hook stays on."""
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.0)
    engine = SimpleNamespace(optimizer=opt, global_steps=10)
    freeze = VarianceFreeze(engine, freeze_step=2, momentum=True, refresh=lambda t: t == 12, refresh_steps=5)
    gen = torch.Generator().manual_seed(4)
    grads = [[torch.randn(8, generator=gen, dtype=torch.float64)] for _ in range(4)]
    p0 = p.detach().clone()
    after = _adamw_run(freeze, engine, opt, [p], lambda t: grads[t], 4, arm_at=0)
    assert freeze.active and freeze.frozen is not None
    assert not torch.equal(after[0][0], p0)  # Adam's own step (no variance to freeze yet)
    assert torch.equal(after[2][0], after[1][0])  # step 12: the refresh, no update
    torch.testing.assert_close(freeze.frozen[0], grads[2][0] ** 2, rtol=0, atol=0)


def test_no_refresh_without_the_optimizer_pre_hook():
    """Where nothing would zero the refresh step's update (the pre-hook is gone), no step is a refresh step."""
    from ds_dragonn.engine.base import HookBase
    from tests.fakes import fake_engine
    p = torch.nn.Parameter(torch.ones(3))
    hook = HookBase(fake_engine(optimizer=torch.optim.AdamW([p], lr=0.1)),
                    DragonnConfig(enabled=True, compress="momentum", warmup_steps=1, variance_refresh_steps=2))
    assert hook._refreshes(2)
    hook.variance_freeze.handle.remove()
    hook.variance_freeze.handle = None
    assert not hook._refreshes(2)


def test_a_changed_refresh_setting_is_reported_on_load():
    from ds_dragonn.engine.state import compare
    now = {"world_size": 2, "rank": 0, "bucketing": {}, "parameters": [], "exchange": "allgather",
           "dragonn": DragonnConfig(enabled=True, variance_refresh_steps=50).model_dump(mode="json")}
    saved = {**now, "dragonn": DragonnConfig(enabled=True).model_dump(mode="json")}
    _, _, kept = compare(saved, now)
    assert any("dragonn.variance_refresh_steps 100 (now 50)" in k for k in kept), kept


def test_a_changed_lr_weighting_resets_the_residuals_on_load():
    """A residual of (lr_t / lr_ref)-weighted momenta is not one of momenta: loading across a change resets."""
    from ds_dragonn.engine.state import compare
    on = DragonnConfig(enabled=True, compress="momentum", lr_weighted_residual=True).model_dump(mode="json")
    off = DragonnConfig(enabled=True, compress="momentum").model_dump(mode="json")
    now = {"world_size": 2, "rank": 0, "bucketing": {}, "parameters": [], "exchange": "allgather", "dragonn": off}
    for saved, current in ((on, off), (off, on)):
        reset, _, _ = compare({**now, "dragonn": saved}, {**now, "dragonn": current})
        assert any("dragonn.lr_weighted_residual" in r and "other units" in r for r in reset), reset
    old = {k: v for k, v in off.items() if k != "lr_weighted_residual"}  # saved before the key existed
    assert compare({**now, "dragonn": old}, now)[0] == []
    mom = LocalMomentum(0.9)  # unweighted: a saved lr_ref is not taken over
    mom.load_state_dict({"momenta": {}, "reference_lr": 0.1})
    assert mom.reference_lr is None


@pytest.mark.parametrize("compress", ["momentum", "auto"])
def test_lr_weighting_is_refused_with_fp16(compress):
    import ds_dragonn
    from tests.fakes import fake_engine
    p = torch.nn.Parameter(torch.ones(3))
    engine = fake_engine(optimizer=torch.optim.AdamW([p], lr=0.1))
    engine.fp16_enabled = lambda: True
    cfg = DragonnConfig(enabled=True, compress=compress, lr_weighted_residual=True)
    with pytest.raises(ds_dragonn.DragonnUnsupportedError, match="'dragonn.lr_weighted_residual': true does not "
                                                                  "support fp16"):
        ds_dragonn._resolve_compress(cfg, engine)
    assert ds_dragonn._resolve_compress(cfg.model_copy(update={"lr_weighted_residual": False}), engine)
