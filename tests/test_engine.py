"""DeepSpeed integration on 2 gloo ranks: the hook is reached, averages like DeepSpeed, and compresses."""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.engine import check_hook_point
from tests.engine_cases import ENGINE_RUNS, ENGINE_STEPS
from tests.multiproc import ranks_fixture

runs = ranks_fixture("tests.engine_cases:engine_runs", "engine", timeout=400, pool="gloo")


def _params_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(ENGINE_RUNS))
def test_ranks_stay_in_sync(runs, name):
    assert _params_equal(runs[0][name]["params"], runs[1][name]["params"])
    assert all(bool(torch.isfinite(p).all()) for p in runs[0][name]["params"])


@pytest.mark.parametrize("dense, dragonn", [("dense", "dragonn_d1"), ("dense_predivide", "dragonn_d1_predivide"),
                                            ("dense", "dragonn_disabled"), ("dense", "dragonn_d1_partitioned")])
def test_density_one_equals_dense_engine(runs, dense, dragonn):
    """Density 1.0 goes through the sparse path (allgather + index_add + averaging) and must give the
    dense engine's parameters bit for bit over several steps (sum of 2 addends is order-free)."""
    for r in range(2):
        assert _params_equal(runs[r][dense]["params"], runs[r][dragonn]["params"])
    if dragonn != "dragonn_disabled":
        t = runs[0][dragonn]["telemetry"]
        assert runs[0][dragonn]["hooked"] and t["compressed_reductions"] == ENGINE_STEPS


def test_pairs_that_cost_more_than_dense_go_dense_under_auto(runs):
    """bf16 at density 1.0: ≤ 1.1 n pairs of 6 bytes against a 2-byte allreduce. ``auto`` sends every
    reduction dense (DeepSpeed's own path: bit for bit the dense engine); ``always`` compresses anyway."""
    auto, always = runs[0]["dragonn_bf16_d1_auto"], runs[0]["dragonn_bf16_d1_always"]
    assert auto["hooked"] and auto["telemetry"]["compressed_reductions"] == 0
    assert auto["telemetry"]["dense_reductions"] == ENGINE_STEPS
    assert auto["telemetry"]["bytes_sent"] <= auto["telemetry"]["dense_bytes_equivalent"]
    for r in range(2):
        assert _params_equal(runs[r]["dense_bf16"]["params"], runs[r]["dragonn_bf16_d1_auto"]["params"])
    t = always["telemetry"]
    assert t["compressed_reductions"] == ENGINE_STEPS and t["bytes_sent"] > 2 * t["dense_bytes_equivalent"]


def test_disabled_block_leaves_engine_untouched(runs):
    assert not runs[0]["dragonn_disabled"]["hooked"] and runs[0]["dragonn_disabled"]["telemetry"] is None


def test_low_density_goes_through_hook_and_sends_less(runs):
    t = runs[0]["dragonn_d001"]["telemetry"]
    assert runs[0]["dragonn_d001"]["hooked"]
    assert t["compressed_reductions"] == ENGINE_STEPS and t["dense_reductions"] == 0
    assert 0 < t["bytes_sent"] < 0.1 * t["dense_bytes_equivalent"]
    assert not _params_equal(runs[0]["dense"]["params"], runs[0]["dragonn_d001"]["params"])


def test_partitioned_exchange_from_the_config_sends_less(runs):
    t = runs[0]["dragonn_d001_partitioned"]["telemetry"]
    assert runs[0]["dragonn_d001_partitioned"]["hooked"]
    assert t["compressed_reductions"] == ENGINE_STEPS and 0 < t["bytes_sent"] < 0.1 * t["dense_bytes_equivalent"]
    assert not _params_equal(runs[0]["dragonn_d001"]["params"], runs[0]["dragonn_d001_partitioned"]["params"])


def test_warmup_uses_dense_allreduce_first(runs):
    t = runs[0]["dragonn_warmup"]["telemetry"]
    assert t["dense_reductions"] == 3 and t["compressed_reductions"] == ENGINE_STEPS - 3


def test_bf16_engine_reaches_hook(runs):
    t = runs[0]["dragonn_bf16"]["telemetry"]
    assert runs[0]["dragonn_bf16"]["hooked"] and t["compressed_reductions"] == ENGINE_STEPS
    assert t["bytes_sent"] < t["dense_bytes_equivalent"]


def test_pipeline_engine_is_refused(runs):
    for r in range(2):
        assert runs[r]["pipeline_error"] is not None and "pipeline" in runs[r]["pipeline_error"]


def test_hook_point_guard():
    """Fails if a DeepSpeed upgrade stops routing ZeRO-0 buckets through allreduce_bucket."""
    check_hook_point()  # the installed DeepSpeed

    class Bypassing:
        def allreduce_and_copy(self, small_bucket, dp_group, dp_world_size=None):
            return self.some_new_path(small_bucket)

    with pytest.raises(RuntimeError, match="bypassed"):
        check_hook_point(Bypassing)


def test_auto_policy_probes_then_every_rank_takes_the_same_decisions(runs):
    t = [runs[r]["dragonn_auto"]["telemetry"] for r in range(2)]
    assert t[0]["dense_reductions"] >= 2 and t[0]["compressed_reductions"] >= 1  # probes (+ a re-check)
    assert t[0]["dense_reductions"] + t[0]["compressed_reductions"] == ENGINE_STEPS
    assert t[0]["compressed_reductions"] == t[1]["compressed_reductions"]
    assert t[0]["dense_ms_mean"] > 0 and t[0]["select_ms_mean"] > 0


def _csv(out_dir, name):
    import csv
    with open(out_dir / "csv" / "mon" / f"Train_dragonn_{name}.csv") as f:
        rows = list(csv.reader(f))[1:]
    return [(int(float(x)), float(v)) for x, v in rows]


def test_monitor_events_on_deepspeeds_sample_axis(runs):
    """Every reduction reaches DeepSpeed's csv monitor at x = global samples (16 per step here): the
    warm-up and the switch in 'compressed', running totals that only grow, and per-phase times."""
    out = runs.out_dir
    compressed = _csv(out, "compressed")
    batch = 8 * 2
    assert [x for x, _ in compressed] == [batch * (i + 1) for i in range(ENGINE_STEPS)]
    assert [v for _, v in compressed] == [0.0, 0.0] + [1.0] * (ENGINE_STEPS - 2)
    totals = [v for _, v in _csv(out, "total_bytes_sent")]
    assert all(b > a for a, b in zip(totals, totals[1:]))
    dense_eq = [v for _, v in _csv(out, "total_dense_bytes_equivalent")]
    assert totals[-1] < dense_eq[-1]
    for phase in ("compensate", "select", "exchange", "residual", "decode"):
        rows = _csv(out, f"{phase}_ms")
        assert len(rows) == ENGINE_STEPS - 2 and all(v >= 0 for _, v in rows)
    assert len(_csv(out, "dense_ms")) == 2


def test_residuals_follow_the_parameters_when_the_trainable_set_changes(runs):
    """Two same-size layers frozen in turn: a's residual is never decoded into b (whose gradient is 0)."""
    assert runs[0]["frozen_b_grads"] == [0.0, 0.0, 0.0]


def test_auto_warm_up_follows_the_engine_learning_rate_warm_up(runs):
    """The default ``"warmup_steps": "auto"``: twice the learning-rate warm-up (at least 30), read from the
    engine's scheduler or, where DeepSpeed has none, followed online; dense until then, compressed after."""
    for r in runs:
        got = {name: (run["warmup_steps"], run["schedule"]) for name, run in r["auto_warmup"].items()}
        assert got == {"WarmupDecayLR": (100, 100), "LambdaLR": (40, 40), "outside": ("auto", 40),
                       "none": ("auto", 30)}
        compressed = {name: run["telemetry"]["compressed_reductions"] for name, run in r["auto_warmup"].items()}
        assert compressed == {"WarmupDecayLR": 0, "LambdaLR": 5, "outside": 5, "none": 15}
