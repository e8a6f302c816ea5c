"""Global selection in engines, and the density schedule."""
from __future__ import annotations

import math

import pytest
import torch

from ds_dragonn.config import DragonnConfig, DragonnConfigError
from ds_dragonn.plan import density_schedule
from ds_dragonn.schedule import UNDECIDED, DensitySchedule
from tests.multiproc import ranks_fixture


# -- the density schedule ---------------------------------------------------------------------------------
def test_density_schedule_is_dgc_exponential():
    s = DensitySchedule(0.001, warmup_steps=10, density_warmup_steps=40, density_warmup_start=0.25)
    assert all(s.at(t) is None and s.dense(t) for t in range(10))
    assert s.at(10) == 0.25 and s.at(50) == s.at(1000) == 0.001
    ds = [s.at(t) for t in range(10, 51)]
    assert all(a > b for a, b in zip(ds, ds[1:]))  # strictly falling
    for j in (0, 13, 39):  # float64 reference: log-linear in the step
        ref = math.exp(math.log(0.25) + (math.log(0.001) - math.log(0.25)) * j / 40)
        assert s.at(10 + j) == pytest.approx(ref, rel=1e-12)
    assert s.warming(10) and s.warming(49) and not s.warming(50) and not s.warming(9)
    assert s.describe().startswith("10 dense warm-up steps") and "0.25 -> 0.001 over 40 steps" in s.describe()


def test_no_density_warmup_when_the_start_is_not_above_the_density():
    s = DensitySchedule(0.5, 0, 100, 0.25)
    assert s.at(0) == 0.5 and not s.warming(0)
    assert DensitySchedule(0.01, 0, 0, 0.25).at(0) == 0.01


@pytest.mark.parametrize("warm, ramp", [(0, 100), (1, 100), (30, 100), (33, 100), (34, 102), (100, 300),
                                        (517, 1551)])
def test_auto_density_warmup_is_three_times_the_dense_warmup_at_least_100(warm, ramp):
    s = DensitySchedule(0.01, warm, "auto", 0.25)
    assert s.steps == ramp and s.auto_steps
    assert s.at(warm) == 0.25 and s.at(warm + ramp) == 0.01 and s.warming(warm + ramp - 1)
    assert not s.warming(warm + ramp)
    j = ramp // 3  # float64 reference
    assert s.at(warm + j) == pytest.approx(0.25 * (0.01 / 0.25) ** (j / ramp), rel=1e-12)
    assert f"over {ramp} steps" in s.describe()


def test_auto_density_warmup_follows_a_dense_warmup_decided_later():
    s = DensitySchedule(0.001, UNDECIDED, "auto", 0.25)
    assert s.at(10_000) is None and "3 times the dense warm-up (at least 1000 steps" in s.describe()
    s.warmup_steps = 80  # what the hook's online tracker does (engine/base.py _end_warmup)
    assert s.steps == 1000  # 1 / density outlasts 3 x 80
    s = DensitySchedule(0.01, UNDECIDED, "auto", 0.25)
    assert "3 times the dense warm-up (at least 100 steps" in s.describe()
    s.warmup_steps = 80
    assert s.steps == 240 and s.at(80) == 0.25 and s.at(320) == 0.01 and s.at(319) > 0.01
    assert DensitySchedule(0.5, 80, "auto", 0.25).steps == 0  # a start not above the density: none
    assert DensitySchedule(0.01, 80, 7, 0.25).steps == 7      # a number stays that number


def test_default_config_schedule_resolves_auto_density_warmup():
    cfg = DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "warmup_steps": 50}})
    assert density_schedule(cfg).steps == 150
    cfg = DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "warmup_steps": 50, "density_warmup_steps": 0}})
    assert density_schedule(cfg).steps == 0
    # local steps send every outer step at the density: no density warm-up, "auto" or a number
    for ramp in ("auto", 200):
        cfg = DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "sync": "local_steps", "local_steps": 3,
                                                        "warmup_steps": 50, "density_warmup_steps": ramp}})
        schedule = density_schedule(cfg)
        assert schedule.steps == 0 and schedule.at(50) == schedule.at(51) == 0.01 and not schedule.warming(51)


def test_config_validates_the_warmup_keys():
    d = DragonnConfig()
    assert d.density_warmup_steps == "auto" and d.warmup_steps == "auto" and d.density_warmup_start == 0.25
    for key, bad in [("density_warmup_steps", -1), ("density_warmup_steps", "Auto"), ("density_warmup_steps", 2.5),
                     ("density_warmup_steps", True)]:
        with pytest.raises(DragonnConfigError, match=f"dragonn.{key}"):
            DragonnConfig.from_ds_config({"dragonn": {"enabled": True, key: bad}})
    for bad in (0.0, 1.5):
        with pytest.raises(DragonnConfigError, match="dragonn.advanced.density_warmup_start"):
            DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "advanced": {"density_warmup_start": bad}}})


# -- in real engines ----------------------------------------------------------------------------------------
engines = ranks_fixture("tests.selection_cases:selection_runs", "selection", pool="gloo")


def test_global_selection_starves_the_quiet_tensors(engines):
    for name in ("global", "zero2_global"):
        moved = engines[0][name]["moved"]
        assert moved["quiet"] == 0 and moved["bias"] == 0, (name, moved)
        assert moved["loud.weight"] > 0


def test_ranks_stay_bit_identical(engines):
    for name in RUNS_NAMES:
        assert all(torch.equal(a, b) for a, b in zip(engines[0][name]["params"], engines[1][name]["params"]))


def test_defaults_warm_up_dense_then_the_density(engines):
    d = engines[0]["defaults"]["telemetry"]
    assert d["dense_reductions"] == 6 and d["compressed_reductions"] == 0  # 30 dense warm-up steps
    w = engines[0]["density_warmup"]
    assert w["telemetry"]["dense_reductions"] == 2 and w["telemetry"]["compressed_reductions"] == 4
    # the last step (global step 5) is compressed step 3 of the 100-step warm-up from 0.25 to 0.01
    assert w["density"] == pytest.approx(0.25 * (0.01 / 0.25) ** (3 / 100))


RUNS_NAMES = ("defaults", "density_warmup", "global", "zero2_global")
