"""The defaults that follow ``density`` and ``sync`` (``plan.resolve_defaults``, the density warm-up's and the
outer lr's ``"auto"``): each resolved value against the rule written out here, explicit keys untouched, the
resolution idempotent, and bad values refused by name."""
from __future__ import annotations

import math

import pytest

from ds_dragonn.config import DragonnConfig, DragonnConfigError
from ds_dragonn.outer import outer_lr_for
from ds_dragonn.plan import resolve_defaults
from ds_dragonn.schedule import DensitySchedule, auto_density_warmup_steps


def _v(x):
    return getattr(x, "value", x)


def _expected(block: dict, stage: int) -> dict:
    """The rule, written independently of plan.py: (density, values, dense_values, max_age)."""
    local = block.get("sync") == "local_steps"
    d = block.get("density", 0.1 if local else 0.01)
    adv = block.get("advanced", {})
    values = adv.get("values", "int4" if d <= 0.1 else "dtype")
    dense = adv.get("dense_values", "auto")  # DeepSpeed's own: int4 dense steps cost the GPT (results.md)
    age = adv.get("max_age", round(0.3 / d) if not local and d <= 0.002 else 0)
    return {"density": d, "values": values, "dense_values": dense, "max_age": age}


BLOCKS = [
    {}, {"density": 0.001}, {"density": 0.002}, {"density": 0.0021}, {"density": 0.1}, {"density": 0.11},
    {"density": 1.0}, {"density": 1e-6}, {"sync": "local_steps"}, {"sync": "local_steps", "density": 0.01},
    {"sync": "local_steps", "density": 1.0}, {"density": 0.001, "advanced": {"max_age": 0}},
    {"density": 0.001, "advanced": {"values": "dtype", "dense_values": "int8", "max_age": 50}},
    {"advanced": {"values": "int8"}}, {"density": 0.5, "advanced": {"values": "int4"}},
]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("block", BLOCKS, ids=[str(b) for b in BLOCKS])
def test_each_default_follows_density_and_sync(block, stage):
    if stage and (block.get("sync") == "local_steps" or "dense_values" in block.get("advanced", {})):
        pytest.skip("refused at ZeRO 1-3 (a row of plan.RULES)")
    cfg = DragonnConfig(enabled=True, **block)
    out, reasons = resolve_defaults(cfg, stage)
    got = {"density": out.density, "values": _v(out.values), "dense_values": _v(out.dense_values),
           "max_age": out.max_age}
    assert got == _expected(block, stage)
    again, _ = resolve_defaults(out, stage)
    assert again is out  # idempotent: the hook resolves again what initialize resolved
    for key in ("values", "max_age"):  # every resolved "auto" has its reason
        assert (key in reasons) == (key not in block.get("advanced", {}))
    assert _v(cfg.values) == block.get("advanced", {}).get("values", "auto")  # the input is not changed


def test_max_age_auto_is_three_tenths_over_the_density():
    for d, age in [(0.001, 300), (0.002, 150), (0.0005, 600), (0.0003, 1000), (0.0007, 429), (0.0011, 273)]:
        out, why = resolve_defaults(DragonnConfig(enabled=True, density=d), 0)
        assert out.max_age == age and why["max_age"] == f"density {d:g}"


@pytest.mark.parametrize("bad", [-1, 1, 2.5, "300", True, None, "Auto"])
def test_max_age_bad_values_are_refused_by_name(bad):
    with pytest.raises((DragonnConfigError, ValueError), match="max_age"):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "advanced": {"max_age": bad}}})


@pytest.mark.parametrize("bad", ["auto4", "bf16", 4, None])
def test_values_bad_names_are_refused_by_name(bad):
    with pytest.raises((DragonnConfigError, ValueError), match="values"):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "advanced": {"values": bad}}})


@pytest.mark.parametrize("density, warmup, steps", [
    (0.01, 100, 300), (0.01, 0, 100), (0.001, 100, 1000), (0.001, 400, 1200), (0.0001, 100, 10000),
    (0.003, 10, 334), (1.0, 0, 100), (0.5, 50, 150)])
def test_density_warmup_auto_outlasts_an_elements_wait(density, warmup, steps):
    assert auto_density_warmup_steps(warmup, density) == steps
    assert steps == max(100, 3 * warmup, math.ceil(1 / density) if density < 1 else 0)
    assert DensitySchedule(density, warmup, "auto").steps == (steps if density < 0.25 else 0)


@pytest.mark.parametrize("workers, density, lr", [(1, 1.0, 1.0), (2, 1.0, 2 ** 0.5), (2, 0.1, 2.0), (4, 0.1, 2.0),
                                                  (9, 0.1, 3.0), (9, 1.0, 3.0), (1, 0.01, 2.0)])
def test_outer_lr_auto_is_at_least_two_for_a_compressed_delta(workers, density, lr):
    assert outer_lr_for("auto", workers, density) == pytest.approx(lr, rel=1e-15)
    assert outer_lr_for(0.7, workers, density) == 0.7  # a number stays as given


@pytest.mark.parametrize("value", ["auto", "dtype"])
@pytest.mark.parametrize("where", [{"zero_optimization": {"stage": 2}}, {}])
def test_writing_out_dense_values_that_run_anyway_is_not_refused(value, where):
    """Only a quantized format is refused outside ZeRO 0 / every step: 'auto' and 'dtype' are what runs there."""
    from ds_dragonn.plan import Facts, refusal
    block = {"enabled": True, "advanced": {"dense_values": value}, **({} if where else {"sync": "local_steps"})}
    cfg = DragonnConfig.from_ds_config({"dragonn": block})
    assert refusal(cfg, Facts.from_ds_config(where), "start") is None


@pytest.mark.parametrize("density", [5e-324, 1e-300, 1e-9])
def test_a_tiny_density_gives_bounded_numbers(density):
    out, why = resolve_defaults(DragonnConfig(enabled=True, density=density), 0)
    assert 0 < out.max_age <= 1 << 31 and auto_density_warmup_steps(0, density) <= 1 << 31
    assert len(why["density_warmup_steps"]) < 60


def test_reasons_print_the_density_as_given():
    _, why = resolve_defaults(DragonnConfig(enabled=True, density=0.1000000001), 0)
    assert why["values"] == "density 0.1000000001 > 0.1"
    _, why = resolve_defaults(DragonnConfig(enabled=True, sync="local_steps", advanced={"values": "dtype"}), 0)
    assert "int4" not in why["density"] and why["density_warmup_steps"].startswith("no effect")


def test_reasons_say_what_runs_at_a_density_at_or_above_the_warm_up_start_and_for_a_dense_delta():
    _, why = resolve_defaults(DragonnConfig(enabled=True, density=0.5), 0)
    assert why["density_warmup_steps"].startswith("none: density 0.5 >= density_warmup_start 0.25")
    _, why = resolve_defaults(DragonnConfig(enabled=True, density=0.01), 0)
    assert why["density_warmup_steps"].startswith("max(100")
    local = DragonnConfig(enabled=True, sync="local_steps", density=1.0, advanced={"values": "int8"})
    _, why = resolve_defaults(local, 0)
    assert why["values"].startswith("not used: the Δ at density 1.0")


def test_the_schedule_line_gives_the_density_to_its_last_digit():
    assert "then density 0.1000001" in DensitySchedule(0.1000001, 10, 0).describe()
