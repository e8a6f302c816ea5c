"""``"warmup_steps": "auto"`` (engine/warmup.py): the learning-rate warm-up read from the engine's scheduler,
checked against the learning rates the scheduler really produces when stepped."""
from __future__ import annotations

import json

import pytest
import torch

from ds_dragonn.config import DragonnConfig
from ds_dragonn.engine.base import HookBase
from ds_dragonn.engine.warmup import AUTO_FACTOR, AUTO_MIN_STEPS, LrWarmupTracker, lr_warmup_steps, \
    resolve_warmup_steps
from ds_dragonn.plan import density_schedule
from ds_dragonn.schedule import UNDECIDED, DensitySchedule
from tests.fakes import fake_engine
from tests.multiproc import run_ranks


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)


def _measured_rise(scheduler, horizon: int) -> int:
    """Reference: step ``scheduler`` over ``horizon`` steps; the first step at which its learning rate is at
    its peak (the steps it rose). DeepSpeed's schedules set their first learning rate at their first step()."""
    opt = scheduler.optimizer
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        scheduler.step()
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(horizon):
        opt.step()
        scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs.index(max(lrs))


def _deepspeed(kind: str, warmup: int, total: int):
    from deepspeed.runtime import lr_schedules as ds
    opt = _optimizer()
    if kind == "WarmupLR":
        return ds.WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=warmup,
                           warmup_type="linear")
    if kind == "WarmupDecayLR":
        return ds.WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=0.0, warmup_max_lr=1e-3,
                                warmup_num_steps=warmup, warmup_type="linear")
    return ds.WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=0.0, warmup_num_steps=warmup,
                             warmup_type="linear")


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("warmup", [2, 7, 50, 333])
def test_deepspeed_schedules_warm_up_for_the_steps_read(kind, warmup):
    total = warmup * 3 + 11
    read = lr_warmup_steps(_deepspeed(kind, warmup, total))
    assert read == _measured_rise(_deepspeed(kind, warmup, total), total - 1)


def _linear_with_warmup(warmup: int, total: int):
    """Hugging Face's ``get_linear_schedule_with_warmup`` multiplier (transformers/optimization.py)."""
    def f(t: int) -> float:
        if t < warmup:
            return t / max(1, warmup)
        return max(0.0, (total - t) / max(1, total - warmup))
    return f


@pytest.mark.parametrize("warmup,total", [(0, 40), (1, 40), (13, 40), (100, 2000), (40, 40)])
def test_lambda_schedules_warm_up_for_the_steps_read(warmup, total):
    make = lambda: torch.optim.lr_scheduler.LambdaLR(_optimizer(), _linear_with_warmup(warmup, total))  # noqa: E731
    assert lr_warmup_steps(make()) == _measured_rise(make(), total + 2)


def test_hugging_face_schedules_are_read():
    transformers = pytest.importorskip("transformers")
    for make, warmup in ((lambda: transformers.get_linear_schedule_with_warmup(_optimizer(), 37, 500), 37),
                         (lambda: transformers.get_cosine_schedule_with_warmup(_optimizer(), 12, 300), 12),
                         (lambda: transformers.get_constant_schedule_with_warmup(_optimizer(), 25), 25),
                         (lambda: transformers.get_constant_schedule(_optimizer()), 0)):
        assert lr_warmup_steps(make()) == warmup == _measured_rise(make(), 600)


def test_several_groups_take_the_longest_rise():
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                             {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [_linear_with_warmup(5, 50), _linear_with_warmup(20, 50)])
    assert lr_warmup_steps(sched) == 20


def test_no_scheduler_is_no_warm_up_and_unknown_ones_are_unread():
    assert lr_warmup_steps(None) == 0
    assert lr_warmup_steps(torch.optim.lr_scheduler.StepLR(_optimizer(), step_size=10)) is None
    forever = torch.optim.lr_scheduler.LambdaLR(_optimizer(), lambda t: float(t))  # a range test never peaks
    assert lr_warmup_steps(forever) is None

    def undefined(t):
        if t > 3:
            raise ZeroDivisionError
        return float(t)
    assert lr_warmup_steps(torch.optim.lr_scheduler.LambdaLR(_optimizer(), undefined)) is None


def _scheduler_warming_up(steps: int):
    return torch.optim.lr_scheduler.LambdaLR(_optimizer(), _linear_with_warmup(steps, steps * 4 + 10))


@pytest.mark.parametrize("lr_warmup", [0, 1, 14, 15, 16, 50, 1000])
def test_auto_is_twice_the_learning_rate_warm_up_and_at_least_the_minimum(lr_warmup):
    engine = fake_engine(lr_scheduler=_scheduler_warming_up(lr_warmup))
    cfg = resolve_warmup_steps(DragonnConfig(enabled=True), engine)
    assert cfg.warmup_steps == max(AUTO_MIN_STEPS, AUTO_FACTOR * lr_warmup)
    assert (AUTO_MIN_STEPS, AUTO_FACTOR) == (30, 2)  # the documented rule (config.py, docs/config.md)


@pytest.mark.parametrize("scheduler", [None, "StepLR"])
def test_an_unread_scheduler_is_followed_online_or_falls_back_to_the_minimum(scheduler, capsys):
    sched = torch.optim.lr_scheduler.StepLR(_optimizer(), step_size=10) if scheduler else None
    engine = fake_engine(lr_scheduler=sched)
    assert resolve_warmup_steps(DragonnConfig(enabled=True), engine).warmup_steps == "auto"
    assert "follows the optimizer's learning rate" in capsys.readouterr().out
    assert resolve_warmup_steps(DragonnConfig(enabled=True), engine, follow=False).warmup_steps == AUTO_MIN_STEPS
    out = capsys.readouterr().out
    if scheduler:  # local steps: no online rule
        assert "warning" in out and "StepLR" in out and "'dragonn.warmup_steps'" in out
    else:  # no scheduler: no learning-rate warm-up to read, and nothing to warn about
        assert "warning" not in out and f"-> {AUTO_MIN_STEPS} dense warm-up steps" in out


def _run_tracker(lrs, tracker=None, first=0):
    """Feed ``lrs[t]`` as step ``first + t``'s learning rate (twice per step, as two buckets do)."""
    tracker = tracker or LrWarmupTracker()
    for t, lr in enumerate(lrs, start=first):
        tracker.observe(t, lr)
        tracker.observe(t, None if lr is None else lr * 7)  # a second reduction of the same step: ignored
    return tracker


@pytest.mark.parametrize("warmup", [0, 1, 14, 15, 16, 37, 300])
def test_the_online_rule_ends_where_the_scheduler_rule_does(warmup):
    """Against the rule read from the scheduler: the same end for a rise then a decay, or a flat top."""
    for f in (_linear_with_warmup(warmup, 4 * warmup + 100),
              lambda t: min(1.0, t / warmup) if warmup else 1.0):
        sched = torch.optim.lr_scheduler.LambdaLR(_optimizer(), f)
        expected = max(AUTO_MIN_STEPS, AUTO_FACTOR * lr_warmup_steps(sched))
        tracker = _run_tracker([1e-3 * f(t) for t in range(expected + 50)])
        assert tracker.end == expected


def test_the_online_rule_takes_the_first_rise_only():
    """A cyclic schedule's next rise, a restart or a staircase do not extend the warm-up (as read from a
    LambdaLR: its first non-rise); a flat start (DeepSpeed's first two steps) is not a peak."""
    triangle = [1e-3 * (t % 250 / 200 if t % 250 < 200 else (250 - t % 250) / 50) for t in range(1200)]
    assert _run_tracker(triangle).end == 2 * 200  # its peak: step 200
    assert _run_tracker([1e-3 * 0.5 ** (t % 10) for t in range(200)]).end == AUTO_MIN_STEPS  # warm restarts
    stairs = lambda t: min(1.0, (t // 10 + 1) / 10)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(_optimizer(), stairs)
    assert _run_tracker([stairs(t) for t in range(200)]).end == max(AUTO_MIN_STEPS, 2 * lr_warmup_steps(sched))
    flat_start = [0.0, 0.0] + [1e-3 * min(1.0, t / 40) for t in range(1, 200)]
    assert _run_tracker(flat_start).end == 2 * 41


def test_a_step_skipped_on_overflow_is_not_a_peak():
    """fp16: DeepSpeed does not step the scheduler on a skipped step, so the next step's learning rate is flat.
    Without ``skipped`` the tracker read steps 2-3 of a 500-step linear warm-up as its peak and ended at 30."""
    f = lambda applied: 1e-3 * min(1.0, applied / 500)  # noqa: E731
    for skips in ((), (2, 3), (2, 3, 250, 251, 252)):
        tracker, applied = LrWarmupTracker(), 0
        for t in range(1200):
            skipped = sum(1 for s in skips if s < t)
            tracker.observe(t, f(applied), skipped)
            tracker.observe(t, f(applied) * 7, skipped)  # a second reduction of the same step: ignored
            applied += t not in skips
        assert tracker.end == 2 * (500 + len(skips))  # the last rise: the step whose `applied` reaches 500


def test_a_multiplicative_schedule_is_not_read_as_a_lambda_one():
    sched = torch.optim.lr_scheduler.MultiplicativeLR(_optimizer(), lambda t: 1.1 if t <= 40 else 1.0)
    assert lr_warmup_steps(sched) is None  # its lambdas are step-to-step factors: followed online instead


def test_the_online_rule_is_one_way_and_waits_for_a_rising_rate():
    rising = _run_tracker([1e-3 * t for t in range(500)])
    assert rising.end is None  # still warming up: still dense
    restart = _run_tracker([1e-3] * 40 + [1e-2] * 10)  # a restart after the end does not reopen the warm-up
    assert restart.end == AUTO_MIN_STEPS
    unknown = _run_tracker([None] * 31)
    assert unknown.end == AUTO_MIN_STEPS


def test_the_online_state_resumes_exactly():
    lrs = [1e-3 * min(1.0, t / 25) for t in range(80)]
    whole = _run_tracker(lrs)
    half = _run_tracker(lrs[:20])
    resumed = LrWarmupTracker()
    resumed.load_state_dict(half.state_dict())
    assert _run_tracker(lrs[20:], resumed, first=20).end == whole.end == 50
    fresh = LrWarmupTracker()
    fresh.load_state_dict({"end": "x", "last_rise": -3, "prev_lr": True})  # malformed: afresh
    assert fresh.state_dict() == LrWarmupTracker().state_dict()


def test_the_hook_follows_the_learning_rate_without_a_scheduler(capsys):
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], lr=0.0)
    engine = fake_engine(optimizer=opt)
    hook = HookBase(engine, DragonnConfig(enabled=True, compress="momentum"))
    assert hook.cfg.warmup_steps == "auto" and hook.schedule.warmup_steps == UNDECIDED
    assert hook.variance_freeze.freeze_step == UNDECIDED
    for step in range(70):
        engine.global_steps = step
        opt.param_groups[0]["lr"] = 1e-3 * min(1.0, step / 20)
        hook._follow_optimizer()
        assert hook.schedule.dense(step) == (step < 40)
    assert hook.schedule.warmup_steps == hook.variance_freeze.freeze_step == 40
    assert "the dense warm-up ends at step 40" in capsys.readouterr().out
    again = HookBase(fake_engine(optimizer=opt), DragonnConfig(enabled=True, compress="momentum"))
    again.load_warmup_state(hook.warmup_tracker.state_dict())
    assert again.schedule.warmup_steps == again.variance_freeze.freeze_step == 40
    again.load_warmup_state(None)  # an earlier state, undecided: dense again
    assert again.schedule.warmup_steps == again.variance_freeze.freeze_step == UNDECIDED
    opt.param_groups[0]["lr"] = None  # (Adafactor's relative steps): unknown, not a crash
    again._follow_optimizer()


def test_resumed_on_more_ranks_every_rank_ends_the_warm_up_together(tmp_path):
    """Saved by 1 rank mid-warm-up (step 40 of a 25-step rise), resumed by 2: the rank without a state file
    takes the saved decision, so both compress from step 50 (a fresh tracker would end at 40: a hang)."""
    run_ranks("tests.warmup_cases:save_mid_warmup", 1, tmp_path, timeout=300)
    run_ranks("tests.warmup_cases:resume_on_more_ranks", 2, tmp_path, timeout=300)
    got = [json.loads((tmp_path / f"grow_{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1]
    assert got[0]["schedule"] == 50 and got[0]["first_compressed"] == 50 and got[0]["tracker"]["end"] == 50
    assert got[0]["none_lr_steps"] == 3  # an optimizer whose lr is None trains (followed as unknown)


def test_the_choice_is_logged(capsys):
    resolve_warmup_steps(DragonnConfig(enabled=True), fake_engine(lr_scheduler=_scheduler_warming_up(50)))
    assert "warmup_steps 'auto' -> 100 dense warm-up steps (the learning-rate warm-up: 50 steps)" in \
        capsys.readouterr().out


@pytest.mark.parametrize("given", [0, 1, 30, 77])
def test_a_number_is_kept_whatever_the_scheduler(given):
    cfg = DragonnConfig(enabled=True, warmup_steps=given)
    assert resolve_warmup_steps(cfg, fake_engine(lr_scheduler=_scheduler_warming_up(500))) is cfg


def test_the_hook_runs_with_the_resolved_warm_up():
    hook = HookBase(fake_engine(lr_scheduler=_scheduler_warming_up(50)), DragonnConfig(enabled=True))
    assert hook.cfg.warmup_steps == 100 and hook.schedule.warmup_steps == 100
    assert hook.schedule.dense(99) and not hook.schedule.dense(100)


def test_an_undecided_schedule_is_dense():
    s = density_schedule(DragonnConfig(enabled=True, compress="momentum"))
    assert s.warmup_steps == UNDECIDED and all(s.dense(t) and not s.refresh(t) for t in (0, 10**6, 10**12))
    assert "learning rate stops rising" in s.describe()
