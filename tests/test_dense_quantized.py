"""The quantized dense allreduce (``advanced.dense_values``: int8 / int4): the dense steps' exchange.

Unit level: shard bounds (empty shards, sizes not divisible by the world size), the byte model against a bf16
ring allreduce, world size 1. Over gloo at 2 and 3 ranks (awkward sizes 0, 1, 2, 63, 64, 65, 1001, 20011):
ranks bit-identical, nothing lost in float64 (``Σ_t out_t + Σ_ranks residual == Σ_t Σ_ranks x_t``: both
roundings stay in the residuals), each step within the rounding bound of the exact sum, a NaN decoded as NaN on
every rank and kept by no residual. Engine (ZeRO 0, 2 ranks): all-dense runs against DeepSpeed's own allreduce
(int8 within 2 %, int4 within 10 % of the weights' change), ranks bit-identical, the telemetry's bytes; the
momentum mode with a quantized warm-up and refresh; config refusals naming the key.
"""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.exchange.dense_quantized import quantized_allreduce, quantized_allreduce_bytes, shard_bounds
from ds_dragonn.exchange.quantize import GROUP, qmax, value_codec
from ds_dragonn.exchange.wire import dense_allreduce_bytes
from tests.dense_quantized_cases import DQ_CASES, DQ_STEPS
from tests.multiproc import ranks_fixture


@pytest.mark.parametrize("numel,world", [(0, 2), (1, 3), (2, 3), (5, 3), (64, 2), (1001, 3), (7, 8)])
def test_shards_cover_the_buffer_in_order(numel, world):
    bounds = shard_bounds(numel, world)
    assert len(bounds) == world and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    lengths = [e - s for s, e in bounds]
    assert max(lengths) - min(lengths) <= 1 and sorted(lengths, reverse=True) == lengths


@pytest.mark.parametrize("world", [2, 3, 8])
def test_bytes_are_about_half_and_a_quarter_of_a_bf16_allreduce(world):
    n = 1_000_003
    bf16 = dense_allreduce_bytes(n, 2, world)
    assert 0.52 < quantized_allreduce_bytes(n, world, value_codec("int8")) / bf16 < 0.54
    assert 0.27 < quantized_allreduce_bytes(n, world, value_codec("int4")) / bf16 < 0.29
    assert quantized_allreduce_bytes(n, 1, value_codec("int8")) == 0


def test_world_size_one_returns_the_input():
    class One:
        world_size, rank = 1, 0
    x = torch.randn(100, dtype=torch.float64)
    red = quantized_allreduce(x, One(), value_codec("int4"))
    assert torch.equal(red.out, x.float()) and torch.equal(red.sent, x.float()) and red.bytes_sent == 0


# -- over gloo ---------------------------------------------------------------------------------------------

dq_runs = ranks_fixture("tests.dense_quantized_cases:dq_cases", "dq", timeout=600, worlds=[2, 3],
                        ids=["2ranks", "3ranks"], pool="gloo")


@pytest.mark.parametrize("i", range(len(DQ_CASES)), ids=[f"{c['values']}-{c['numel']}-{str(c['dtype'])[6:]}"
                                                        for c in DQ_CASES])
def test_ranks_agree_and_nothing_is_lost(dq_runs, i):
    world, records = dq_runs
    case = DQ_CASES[i]
    runs = [r["results"][i] for r in records]
    for step in range(DQ_STEPS):
        for other in runs[1:]:
            assert torch.equal(other[step]["out"], runs[0][step]["out"]), "ranks decoded different sums"
    applied = sum(runs[0][t]["out"].double() for t in range(DQ_STEPS))
    held = sum(r[-1]["residual"].double() for r in runs)
    given = sum(r[t]["x"].double() for r in runs for t in range(DQ_STEPS))
    scale = float(given.abs().max()) if case["numel"] else 1.0
    # float32 sums and, in bf16, the rounding of the result to the wire dtype (not a residual's to keep)
    tol = (4e-6 if case["dtype"] == torch.float32 else 3 * 2 ** -8) * scale * DQ_STEPS
    assert _maxabs(applied + held - given) <= tol
    # one step against the exact sum
    exact = sum(r[0]["x"].double() for r in runs)
    bits = 8 if case["values"] == "int8" else 4
    # half a step of each rank's coarsest group, and of the sum's (the owner's re-quantization)
    coarsest = sum(_maxabs(r[0]["x"].double()) for r in runs) + _maxabs(exact)
    bound = 0.5 * coarsest / qmax(bits) * 1.01 + tol
    assert _maxabs(runs[0][0]["out"].double() - exact) <= bound


def _maxabs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def test_a_nan_decodes_as_nan_everywhere_and_no_residual_keeps_it(dq_runs):
    world, records = dq_runs
    for r in records:
        out = r["nan_out"]
        assert bool(out[128:192].isnan().all()), "the NaN's group of 64 decodes as NaN"
        assert bool(torch.isfinite(out[:128]).all()) and bool(torch.isfinite(out[192:]).all())
        assert bool(torch.isfinite(r["nan_residual"]).all())
    assert all(torch.equal(r["nan_out"].nan_to_num(), records[0]["nan_out"].nan_to_num()) for r in records)


def test_every_step_sends_what_the_model_says(dq_runs):
    world, records = dq_runs
    for i, case in enumerate(DQ_CASES):
        model = quantized_allreduce_bytes(case["numel"], world, value_codec(case["values"]))
        for r in records:
            assert all(s["bytes_sent"] <= model for s in r["results"][i])


# -- the engine (ZeRO 0) -----------------------------------------------------------------------------------

def _engines(dq_runs, name):
    world, records = dq_runs
    return [r["engines"][name] for r in records]


@pytest.mark.parametrize("name,rel", [("warmup_int8", 0.02), ("warmup_int4", 0.10)])
def test_quantized_dense_steps_follow_deepspeeds_allreduce(dq_runs, name, rel):
    runs, dense, plain = _engines(dq_runs, name), _engines(dq_runs, "dense"), _engines(dq_runs, "warmup_auto")
    init = _initial_params()
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], runs[0]["params"])), "ranks' weights differ"
    for a, b in zip(plain[0]["params"], dense[0]["params"]):
        assert torch.equal(a, b), "dense steps through the hook are DeepSpeed's own"
    moved = torch.cat([(p - p0).flatten() for p, p0 in zip(dense[0]["params"], init)])
    diff = torch.cat([(p - q).flatten() for p, q in zip(runs[0]["params"], dense[0]["params"])])
    assert float(diff.norm()) <= rel * float(moved.norm())
    tel, auto = runs[0]["telemetry"], plain[0]["telemetry"]
    assert tel["dense_reductions"] == auto["dense_reductions"] > 0 and tel["compressed_reductions"] == 0
    assert tel["dense_bytes_equivalent"] == auto["dense_bytes_equivalent"]
    # against DeepSpeed's fp32 ring allreduce (4 bytes a value): int8 ~1.06, int4 ~0.56 bytes, block padding
    assert tel["bytes_sent"] < (0.30 if name.endswith("int8") else 0.17) * auto["bytes_sent"]


def _initial_params():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 10))
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["momentum_int8", "gradient_int4_bf16"])
def test_quantized_warmup_then_compressed_steps(dq_runs, name):
    runs = _engines(dq_runs, name)
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], runs[0]["params"]))
    assert all(bool(torch.isfinite(p).all()) for p in runs[0]["params"])
    tel = runs[0]["telemetry"]
    assert tel["compressed_reductions"] > 0 and tel["dense_reductions"] > 0
    if name.startswith("momentum"):
        assert runs[0]["refreshed"] >= 1, "a variance refresh went through the quantized path"
        # the warm-up's rounding buffer is freed once it ends, and a refresh keeps none: only the momentum's
        assert "dense" not in runs[0]["residual_hooks"] and runs[0]["residual_hooks"], runs[0]["residual_hooks"]


def test_a_bucket_too_small_to_pay_goes_through_deepspeeds_allreduce(dq_runs):
    tiny, dense = _engines(dq_runs, "tiny_int8"), _engines(dq_runs, "tiny_dense")
    assert all(torch.equal(a, b) for a, b in zip(tiny[0]["params"], dense[0]["params"]))
    tel = tiny[0]["telemetry"]
    assert tel["dense_reductions"] == 3 and tel["bytes_sent"] == tel["dense_bytes_equivalent"]


@pytest.mark.parametrize("dragonn,match", [
    ({"sync": "local_steps", "advanced": {"dense_values": "int8"}}, "dense_values"),
    ({"advanced": {"dense_values": "int2"}}, "dense_values"),
])
def test_bad_settings_name_the_key(dragonn, match):
    from ds_dragonn.config import DragonnConfig, DragonnConfigError
    with pytest.raises(DragonnConfigError, match=match):
        DragonnConfig.from_ds_config({"dragonn": dragonn})


def test_zero_stages_above_0_refuse_it():
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.plan import DragonnUnsupportedError, Facts, check
    cfg = DragonnConfig.from_ds_config({"dragonn": {"advanced": {"dense_values": "int8"}}})
    with pytest.raises(DragonnUnsupportedError, match="dense_values"):
        check(cfg, Facts.from_ds_config({"zero_optimization": {"stage": 2}}), "start")
