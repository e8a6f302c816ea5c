"""Skipped (overflow) steps: exact (no trace) where asked or under fp16, else what they sent returns to the
residuals (O(k)); the fp16 loss scale is followed.

Unit level (always): the transactional residual store against the in-place one, the partitioned
exchange's undo log, and the step guard with a fake engine (DeepSpeed refuses fp16 engines on CPU).
Engine level (2 gloo ranks): bf16 engines, whose steps DeepSpeed skips on overflow by default.
"""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.engine.steps import StepGuard, loss_scale
from ds_dragonn.feedback import ErrorFeedback
from tests.multiproc import ranks_fixture
from tests.step_cases import BAD_STEP, LIGHT_RUNS, SKIP_RUNS, SKIP_STEPS


def _bucket(dtype, contiguous=True):
    """A bucket of awkward tensor shapes (one empty), fresh values."""
    shapes = [(3, 5), (0,), (7,), (2, 3, 4), (1,)]
    ts = [torch.randn(s).to(dtype) for s in shapes]
    if not contiguous:
        ts[0] = torch.randn(5, 3).to(dtype).t()
    return ts


def _select_commit(ef, key, buf, n_sent=4):
    idx = torch.randperm(buf.numel())[:n_sent].to(torch.int32)
    kept = buf[idx.long()].clone()
    sent = kept.to(torch.bfloat16)  # the wire's rounding stays in the residual
    ef.commit(key, idx, kept, sent)


@pytest.mark.parametrize("dtype,contiguous", [(torch.float32, True), (torch.bfloat16, True),
                                              (torch.float16, True), (torch.float32, False),
                                              (torch.float64, True)])
def test_transactional_store_equals_in_place_when_applied_and_restores_when_skipped(dtype, contiguous):
    plain, txn = ErrorFeedback(True), ErrorFeedback(True, transactional=True)
    history = []
    for step in range(6):
        skip = step in (2, 3)  # two skipped steps in a row
        micro = 2 if step == 4 else 1  # micro steps of one step (ZeRO-2 reduces at each)
        before = {k: v.clone() for k, v in txn.residuals.items()}
        for m in range(micro):
            grads = _bucket(dtype, contiguous)
            zero = m == 0 and contiguous
            a = txn.compensate_("b", [g.clone() for g in grads], dtype, prescale=0.5, zero_inputs=zero)
            torch.manual_seed(100 * step + m)
            _select_commit(txn, "b", a)
            if not skip:
                p = plain.compensate_("b", [g.clone() for g in grads], dtype, prescale=0.5)
                torch.manual_seed(100 * step + m)
                _select_commit(plain, "b", p)
                assert torch.equal(a, p)
        txn.end_step(applied=not skip)
        if skip:  # exactly as before the step
            assert all(torch.equal(before[k], txn.residuals[k]) for k in before)
        history.append(txn.residuals["b"].clone())
    assert torch.equal(txn.residuals["b"], plain.residuals["b"])
    assert not torch.equal(history[1], history[4])


def test_transactional_zeroes_inputs_and_keeps_last_applied_buffer():
    txn = ErrorFeedback(True, transactional=True)
    g = [torch.ones(10), torch.full((5,), 2.0)]
    buf = txn.compensate_("k", g, torch.float32, zero_inputs=True)
    assert all(float(t.abs().sum()) == 0 for t in g)
    assert torch.equal(buf, torch.tensor([1.0] * 10 + [2.0] * 5))
    assert float(txn.residuals["k"].abs().sum()) == 0  # the residual itself was only read
    txn.end_step(True)
    assert torch.equal(txn.residuals["k"], buf)


class _Store:
    def __init__(self):
        self.calls = []

    def end_step(self, applied):
        self.calls.append(("end", applied))

    def rescale_(self, factor):
        self.calls.append(("rescale", factor))


def test_step_guard_ends_each_step_once_and_follows_the_loss_scale():
    store, state = _Store(), {"skipped": 0, "scale": 65536.0}
    guard = StepGuard(lambda: [store], lambda: state["skipped"], lambda: state["scale"])
    guard.begin(0)
    guard.begin(0)  # a second bucket of the same step
    assert store.calls == []
    state["skipped"] = 1  # DeepSpeed skipped step 0 (overflow) and halved the scale
    state["scale"] = 32768.0
    guard.begin(1)
    assert store.calls == [("end", False), ("rescale", 0.5)] and guard.restored_steps == 1
    store.calls.clear()
    guard.begin(2)  # step 1 applied, scale unchanged
    assert store.calls == [("end", True)]
    store.calls.clear()
    state["scale"] = 65536.0  # doubled after a clean window
    guard.begin(3)
    assert store.calls == [("end", True), ("rescale", 2.0)]


def test_step_guard_counts_the_skipped_steps_of_the_age_clock():
    """A skipped step that used up an index of the age clock is counted (its block was rolled back), a skipped
    warm-up or refresh step is not; applied steps never are."""
    from ds_dragonn.schedule import DensitySchedule
    schedule = DensitySchedule(0.01, warmup_steps=3, refresh_steps=4)  # refreshes at 6, 10, ...
    state = {"skipped": 0}
    guard = StepGuard(lambda: [], lambda: state["skipped"], lambda: 1.0, ticks=schedule.ticks)
    counted = []
    for step in range(12):
        guard.begin(step)
        if step in (1, 4, 6, 7):  # skipped: a warm-up step, two compressed steps, a refresh
            state["skipped"] += 1
        guard.begin(step)  # a second bucket of the same step
        guard.end()
        counted.append(guard.skipped_ticks)
    assert [schedule.ticks(s) for s in range(12)] == [False] * 3 + [True] * 3 + [False] + [True] * 3 + [False, True]
    assert counted == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2] and guard.restored_steps == 4


def test_the_age_clock_survives_a_checkpoint():
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.engine.base import HookBase
    from tests.fakes import fake_engine
    engine = fake_engine(global_steps=9)
    cfg = DragonnConfig(enabled=True, warmup_steps=2)
    src = HookBase(engine, cfg)
    src.steps.skipped_ticks = 3
    assert src.age_clock(9) == 9 - 2 - 3
    dst = HookBase(engine, cfg)
    dst.load_state_dict(src.state_dict())
    assert dst.age_clock(9) == src.age_clock(9) == 4
    for bad in (-1, True, 2.5, "3"):  # not a count: the clock counts no skipped step
        state = src.state_dict()
        state["age_skipped"] = bad
        dst.load_state_dict(state)
        assert dst.steps.skipped_ticks == 0
    # a state that does not apply here (another world size) starts the residuals empty, and the clock with them:
    # the same 0 on every rank, whether its file was reset or missing
    other = src.state_dict()
    other["world_size"] = other["description"]["world_size"] = 2
    dst.load_state_dict(other)
    assert dst.steps.skipped_ticks == 0 and dst.age_clock(9) == 7
    # a resume with a longer warm-up counts fewer compressed steps than were skipped: never below 0
    longer = HookBase(engine, DragonnConfig(enabled=True, warmup_steps=8))
    longer.load_state_dict(src.state_dict())
    assert longer.steps.skipped_ticks == 3 and longer.age_clock(9) == 0 and longer.age_clock(13) == 2


def test_residuals_follow_a_changed_loss_scale_exactly():
    """Residuals are kept in the units of the gradients they meet: rescaled by S_new/S_old (exact)."""
    ef = ErrorFeedback(True, transactional=True)
    store = {"scale": 1024.0}
    guard = StepGuard(lambda: [ef], lambda: 0, lambda: store["scale"])
    true_grad = torch.randn(100)
    guard.begin(0)
    buf = ef.compensate_("b", [true_grad * 1024.0], torch.float32)  # fp16 gradients arrive scaled
    _select_commit(ef, "b", buf, n_sent=0)
    store["scale"] = 512.0
    guard.begin(1)
    torch.testing.assert_close(ef.residuals["b"], true_grad * 512.0, rtol=0, atol=0)


def test_loss_scale_reads_deepspeed_optimizers():
    class E:
        pass
    e = E()
    e.optimizer = type("O", (), {"loss_scale": 4096.0})()
    assert loss_scale(e) == 4096.0
    e.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert loss_scale(e) == 1.0
    e.optimizer = type("O", (), {"loss_scale": None})()  # fp16 optimizer without grad scaling
    assert loss_scale(e) == 1.0


skips = ranks_fixture("tests.step_cases:skip_runs", "skip", timeout=300, pool="gloo")


@pytest.mark.parametrize("name", list(SKIP_RUNS))
def test_skipped_step_leaves_every_residual_as_before(skips, name):
    for r in range(2):
        run = skips[r][name]
        assert run["transactional"] and run["restored"] == 1
        before, bad, after = (run["steps"][BAD_STEP + d] for d in (-1, 0, 1))
        assert bad["skipped"] == 1 and before["skipped"] == 0  # DeepSpeed skipped it on every rank
        assert before["residuals"].keys() == bad["residuals"].keys() and before["residuals"]
        for k, v in before["residuals"].items():
            assert torch.equal(v, bad["residuals"][k]), f"rank {r} residual {k} changed by the skipped step"
        assert all(torch.equal(a, b) for a, b in zip(before["params"], bad["params"]))
        # the next step is clean: finite, and it moves on
        assert all(bool(torch.isfinite(v).all()) for v in after["residuals"].values())
        assert all(bool(torch.isfinite(p).all()) for p in run["steps"][-1]["params"])
        assert not all(torch.equal(a, b) for a, b in zip(bad["params"], after["params"]))
    # the age bound's clock: the skipped step's index goes to the next step, whose block was not sent
    clocks = [skips[r][name]["steps"][s]["age_clock"] for r in range(2) for s in range(SKIP_STEPS)]
    expected = [s + 1 - (s >= BAD_STEP) for s in range(SKIP_STEPS)]
    assert clocks == expected * 2
    for step in range(SKIP_STEPS):  # ranks identical throughout
        assert all(torch.equal(a, b) for a, b in zip(skips[0][name]["steps"][step]["params"],
                                                     skips[1][name]["steps"][step]["params"]))


@pytest.mark.parametrize("name", list(LIGHT_RUNS))
def test_skipped_step_returns_what_it_sent_and_training_goes_on(skips, name):
    """bf16 and fp32 (``exact_skipped_steps`` unset): no working copies; the skipped step changes no parameter, every
    residual and momentum is finite afterwards (rank 0's gradient was all Inf/NaN: its entries were reset), rank 1's
    residual grew by its gradient (what it sent came back: the residual is larger than before, not emptied), and the
    next steps move on, ranks identical."""
    for r in range(2):
        run = skips[r][name]
        assert not run["transactional"] and run["restored"] == 1
        before, bad, after = (run["steps"][BAD_STEP + d] for d in (-1, 0, 1))
        assert bad["skipped"] == 1 and before["skipped"] == 0  # DeepSpeed skipped it on every rank
        assert all(torch.equal(a, b) for a, b in zip(before["params"], bad["params"]))
        for rec in (bad, after, run["steps"][-1]):
            for store in ("residuals", "momenta"):
                assert all(bool(torch.isfinite(v).all()) for v in rec[store].values()), (r, store)
        assert all(bool(torch.isfinite(p).all()) for p in run["steps"][-1]["params"])
        assert not all(torch.equal(a, b) for a, b in zip(bad["params"], after["params"]))
        assert run["steps"][-1]["skipped"] == 1  # one skip only: nothing non-finite stayed behind
        if r == 1:  # finite gradient: what it sent came back, so its residual holds more than a sent step leaves
            grew = sum(float(v.abs().sum()) for v in bad["residuals"].values())
            assert grew > sum(float(v.abs().sum()) for v in before["residuals"].values())
    for step in range(SKIP_STEPS):
        assert all(torch.equal(a, b) for a, b in zip(skips[0][name]["steps"][step]["params"],
                                                     skips[1][name]["steps"][step]["params"]))


def test_light_store_returns_what_a_skipped_step_sent_in_float64():
    """``undo_sent``: after a skipped step (two micro steps) the residual is ``old + both gradients`` (float64: to
    its rounding), non-finite entries 0; an applied step is the in-place store's result exactly."""
    light, plain = ErrorFeedback(True, undo_sent=True), ErrorFeedback(True)
    for step in range(4):
        skip = step == 2
        before = light.residuals["b"].clone() if "b" in light.residuals else None
        added = 0.0
        for m in range(2):
            grads = _bucket(torch.float64)
            if skip and m == 1:
                grads[2][3] = float("inf")
            a = light.compensate_("b", [g.clone() for g in grads], torch.float64)
            torch.manual_seed(10 * step + m)
            _select_commit(light, "b", a)
            added = added + torch.cat([g.flatten() for g in grads])
            if not skip:
                p = plain.compensate_("b", [g.clone() for g in grads], torch.float64)
                torch.manual_seed(10 * step + m)
                _select_commit(plain, "b", p)
                assert torch.equal(a, p)
        light.end_step(applied=not skip)
        if skip:
            want = before + added
            bad = ~torch.isfinite(want)
            assert bool(bad.any()) and torch.equal(light.residuals["b"][bad], torch.zeros(int(bad.sum()),
                                                                                          dtype=torch.float64))
            torch.testing.assert_close(light.residuals["b"][~bad], want[~bad], rtol=0, atol=1e-12)
            plain.residuals["b"] = light.residuals["b"].clone()
    assert torch.equal(light.residuals["b"], plain.residuals["b"])
    assert not light.undo.log and not light.undo.opened


def test_resumed_residuals_keep_the_loss_scale_they_were_saved_in():
    """Saved right after an overflow (scale halved, residual not yet rescaled): the resumed run rescales it at
    its first reduction, as the uninterrupted run would have."""
    from types import SimpleNamespace

    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.engine.base import HookBase
    from tests.fakes import fake_engine
    opt = SimpleNamespace(loss_scale=1024.0)
    engine = fake_engine(global_steps=5, optimizer=opt)
    src = HookBase(engine, DragonnConfig(enabled=True))
    src.steps.begin(5)
    src.error_feedback.residuals["b"] = torch.full((4,), 3.0)
    opt.loss_scale = 512.0  # the step overflowed: DeepSpeed halved the scale
    engine.global_steps = 6
    state = src.state_dict()
    assert state["loss_scale_units"] == 1024.0
    dst = HookBase(engine, DragonnConfig(enabled=True))
    dst.load_state_dict(state)
    dst.steps.begin(6)
    assert torch.equal(dst.error_feedback.residuals["b"], torch.full((4,), 1.5))


def test_bf16_optimizer_may_skip_whatever_check_grad_overflow_says():
    """DeepSpeed's BF16_Optimizer returns early on a non-finite gradient norm (bf16_optimizer.py ``step``) even
    with ``"check_grad_overflow": false``: the step transaction stays on there."""
    from types import SimpleNamespace

    from ds_dragonn.engine.steps import may_skip_steps

    class BF16_Optimizer:  # noqa: N801 - DeepSpeed's class name is what is checked
        pass

    off = SimpleNamespace(check_grad_overflow=False)
    engine = SimpleNamespace(fp16_enabled=lambda: False, bfloat16_enabled=lambda: True,
                             _config=SimpleNamespace(bfloat16_config=off), optimizer=BF16_Optimizer())
    assert may_skip_steps(engine)
    engine.optimizer = object()  # ZeRO 1/2: DeepSpeed's ZeRO optimizer follows check_grad_overflow
    engine.zero_optimization_stage = lambda: 2
    assert not may_skip_steps(engine)
    off.check_grad_overflow = True
    assert may_skip_steps(engine)
    engine.zero_optimization_stage = lambda: 3  # ZeRO 3 skips on a non-finite norm in any dtype
    off.check_grad_overflow = False
    assert may_skip_steps(engine)


@pytest.mark.parametrize("stage,compute_norm,skips", [(0, True, False), (1, True, True), (2, False, False),
                                                       (3, False, True)])
def test_fp32_engines_may_skip_where_deepspeed_checks_the_norm(stage, compute_norm, skips):
    """fp32: ZeRO 1/2 skip a step whose norm is not finite when they compute it (``compute_grad_norm``, default
    true), ZeRO 3 always, ZeRO 0 (the plain optimizer) never; none runs the step transaction by default."""
    from types import SimpleNamespace

    from ds_dragonn.engine.steps import may_skip_steps, step_transaction
    engine = SimpleNamespace(fp16_enabled=lambda: False, bfloat16_enabled=lambda: False, optimizer=object(),
                             zero_optimization_stage=lambda: stage,
                             _config=SimpleNamespace(zero_config=SimpleNamespace(compute_grad_norm=compute_norm)))
    assert may_skip_steps(engine) == skips
    assert not step_transaction(engine, None)
    assert step_transaction(engine, True) == skips
