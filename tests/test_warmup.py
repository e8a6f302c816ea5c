"""``"warmup_steps": "auto"`` (engine/warmup.py): the learning-rate warm-up read from the engine's scheduler,
checked against the learning rates the scheduler really produces when stepped."""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.config import DragonnConfig
from ds_dragonn.engine.base import HookBase
from ds_dragonn.engine.warmup import AUTO_FACTOR, AUTO_MIN_STEPS, lr_warmup_steps, resolve_warmup_steps
from ds_dragonn.schedule import DensitySchedule
from tests.fakes import fake_engine


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
    engine = fake_engine(lr_scheduler=_scheduler_warming_up(lr_warmup) if lr_warmup else None)
    cfg = resolve_warmup_steps(DragonnConfig(enabled=True), engine)
    assert cfg.warmup_steps == max(AUTO_MIN_STEPS, AUTO_FACTOR * lr_warmup)
    assert (AUTO_MIN_STEPS, AUTO_FACTOR) == (30, 2)  # the documented rule (config.py, docs/config.md)


def test_an_unread_scheduler_falls_back_to_the_minimum_and_says_so(capsys):
    engine = fake_engine(lr_scheduler=torch.optim.lr_scheduler.StepLR(_optimizer(), step_size=10))
    cfg = resolve_warmup_steps(DragonnConfig(enabled=True), engine)
    assert cfg.warmup_steps == AUTO_MIN_STEPS
    out = capsys.readouterr().out
    assert "warning" in out and "StepLR" in out and "'dragonn.warmup_steps'" in out


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


def test_an_unresolved_auto_is_refused_by_the_schedule():
    with pytest.raises(ValueError, match="resolved"):
        DensitySchedule.from_config(DragonnConfig(enabled=True))
