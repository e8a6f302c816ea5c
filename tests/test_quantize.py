"""Quantized values on the wire (``advanced.values``: int8 / int4 with a float32 scale per 64 values).

Unit level (no process group): the codec's rounding bound, int4 packing of odd counts, groups not full,
0 and 1 values, non-finite groups, block sizes. Over gloo at 2 and 3 ranks, every exchange scheme: ranks
bit-identical, nothing lost in float64 (``P × applied + Σ worker residuals + Σ server residuals == Σ raw
gradients``: the rounding stays in the residuals), fewer bytes than the same exchange with plain values, within
``max_bytes``, and ranks on different formats all get one clear error.
"""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.exchange.ownership import HashedOwnership
from ds_dragonn.exchange.quantize import (GROUP, PLAIN, dequantize, pack_int4, qmax, quantize, unpack_int4,
                                          value_codec)
from tests.multiproc import ranks_fixture
from tests.quantize_cases import QUANT_CASES, QUANT_STEPS, quant_case_id, quant_input

COUNTS = [0, 1, 2, 63, 64, 65, 127, 1001]


# -- the codec, no process group -------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("count", COUNTS)
def test_rounding_error_is_at_most_half_a_step_per_group(bits, count):
    g = torch.Generator().manual_seed(count)
    v = torch.randn(count, generator=g, dtype=torch.float64) * torch.rand(count, generator=g, dtype=torch.float64) ** 3
    q = quantize(v, bits)
    assert q.codes.dtype == torch.int8 and q.codes.numel() == count
    assert q.scales.dtype == torch.float32 and q.scales.numel() == -(-count // GROUP)
    assert int(q.codes.abs().max()) <= qmax(bits) if count else True
    deq = dequantize(q.codes, q.scales, torch.float64)
    step = q.scales.double().repeat_interleave(GROUP)[:count]
    # half a step, plus the float32 rounding of v and of the scale
    assert bool(((v - deq).abs() <= step * 0.5 * (1 + 1e-5) + v.abs() * 1e-6).all())
    for grp in range(q.scales.numel()):  # the group's largest magnitude uses the largest code
        codes = q.codes[grp * GROUP:(grp + 1) * GROUP]
        assert int(codes.abs().max()) == qmax(bits) or float(q.scales[grp]) == 0.0


@pytest.mark.parametrize("count", COUNTS)
def test_int4_packing_round_trips_odd_counts(count):
    codes = torch.randint(-7, 8, (count,), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-count // 2)
    assert torch.equal(unpack_int4(packed, count), codes)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("count", COUNTS)
def test_write_then_read_gives_what_write_returned(fmt, dtype, count):
    """Every rank reads bit for bit what the sender's residual commit subtracts."""
    codec = value_codec(fmt)
    cap = count + 3  # a padded block (the allgather pads to the largest count)
    v = (torch.randn(count, generator=torch.Generator().manual_seed(1)) * 10).to(dtype)
    block = torch.zeros(codec.block_bytes(cap, dtype), dtype=torch.uint8)
    sent = codec.write(block, v, cap)
    got = codec.read(block, count, cap, dtype)
    assert sent.dtype == dtype and got.dtype == dtype and got.numel() == count
    assert torch.equal(got.view(torch.uint8), sent.view(torch.uint8))
    assert block.numel() % 8 == 0


def test_zeros_and_non_finite_groups():
    codec = value_codec("int8")
    v = torch.zeros(3 * GROUP)
    v[GROUP + 5] = float("nan")
    v[2 * GROUP] = 2.0
    v[2 * GROUP + 1] = float("inf")
    block = torch.zeros(codec.block_bytes(v.numel(), v.dtype), dtype=torch.uint8)
    sent = codec.write(block, v, v.numel())
    assert torch.equal(sent[:GROUP], torch.zeros(GROUP))  # a group of zeros: scale 0, exact
    assert bool(sent[GROUP:].isnan().all()), "a group holding NaN/Inf decodes as NaN (the overflow check sees it)"


def test_block_bytes():
    assert PLAIN.block_bytes(10, torch.bfloat16) == 24  # 20 bytes, aligned
    assert value_codec("int8").block_bytes(0, torch.bfloat16) == 0
    assert value_codec("int8").block_bytes(1, torch.bfloat16) == 8 + 8
    assert value_codec("int8").block_bytes(1000, torch.bfloat16) == 64 + 1000
    assert value_codec("int4").block_bytes(1001, torch.float32) == 64 + 504
    with pytest.raises(ValueError):
        value_codec("int2")


# -- every exchange scheme over gloo ---------------------------------------------------------------------

quant_runs = ranks_fixture("tests.quantize_cases:quant_cases", "quant", timeout=600, worlds=[2, 3],
                           ids=["2ranks", "3ranks"], pool="gloo")


@pytest.fixture(scope="module")
def quant(quant_runs):
    world, saved = quant_runs
    return world, [s["results"] for s in saved], saved


IDS = [quant_case_id(c) for c in QUANT_CASES]
SHARED = [i for i, c in enumerate(QUANT_CASES) if c["exchange"] != "reduce_scatter"]
F64 = [i for i, c in enumerate(QUANT_CASES) if c["dtype"] == torch.float64]


@pytest.mark.parametrize("ci", SHARED, ids=[IDS[i] for i in SHARED])
def test_ranks_end_bit_identical(quant, ci):
    world, ranks, _ = quant
    for step in range(QUANT_STEPS):
        outs = [ranks[r][ci]["quant"][step]["out"] for r in range(world)]
        for o in outs[1:]:
            assert o.dtype == outs[0].dtype and torch.equal(o.view(torch.uint8), outs[0].view(torch.uint8))


@pytest.mark.parametrize("ci", F64, ids=[IDS[i] for i in F64])
def test_nothing_lost_with_the_rounding_in_the_residual(quant, ci):
    """float64: everything applied × P + all worker and server residuals == all raw gradients, although the
    values travelled as int8/int4 codes (and the partitioned owners re-quantized theirs)."""
    world, ranks, _ = quant
    case = QUANT_CASES[ci]
    n = case["numel"]
    raw = torch.zeros(n, dtype=torch.float64)
    applied = torch.zeros(n, dtype=torch.float64)
    for step in range(QUANT_STEPS):
        if case["exchange"] == "reduce_scatter":
            applied += sum(ranks[r][ci]["quant"][step]["out"] for r in range(world))
        else:
            applied += ranks[0][ci]["quant"][step]["out"]
        for r in range(world):
            raw += quant_input(ci, r, step, n, case["dtype"])
    held = torch.zeros(n, dtype=torch.float64)
    own = HashedOwnership(n, world)
    for r in range(world):
        last = ranks[r][ci]["quant"][QUANT_STEPS - 1]
        held += last["residual"]
        if case["exchange"] == "partitioned":
            held.index_add_(0, own.to_index(r, torch.arange(last["server"].numel())), last["server"])
    torch.testing.assert_close(applied * world + held, raw, rtol=1e-12,
                               atol=1e-12 * (1 + float(raw.abs().max()) if n else 1))


@pytest.mark.parametrize("ci", range(len(QUANT_CASES)), ids=IDS)
def test_bytes_below_plain_values_and_within_the_bound(quant, ci):
    world, ranks, _ = quant
    case = QUANT_CASES[ci]
    for r in range(world):
        for step in range(QUANT_STEPS):
            q, p = ranks[r][ci]["quant"][step]["stats"], ranks[r][ci]["plain"][step]["stats"]
            assert q["bytes_sent"] <= q["max_bytes"], (q["bytes_sent"], q["max_bytes"])
            if step == 0 and case["numel"] >= 20_011 and case["exchange"] == "allgather":  # same pairs: fewer bytes
                assert q["kept"] == p["kept"]
                value_bytes = case["dtype"].itemsize - (1.0 if case["values"] == "int8" else 0.5) - 4 / GROUP
                assert p["bytes_sent"] - q["bytes_sent"] >= 0.9 * value_bytes * q["kept"] * (world - 1)
            if case["numel"] >= 20_011:
                assert q["bytes_sent"] < p["bytes_sent"]


@pytest.mark.parametrize("ci", [i for i in F64 if QUANT_CASES[i]["numel"] >= 1000],
                         ids=[IDS[i] for i in F64 if QUANT_CASES[i]["numel"] >= 1000])
def test_the_values_were_quantized(quant, ci):
    """The quantized run differs from the plain one (the rounding is real), and stays close to it."""
    world, ranks, _ = quant
    q, p = ranks[0][ci]["quant"][0]["out"], ranks[0][ci]["plain"][0]["out"]
    assert not torch.equal(q, p)
    if QUANT_CASES[ci]["exchange"] == "partitioned":  # the owners' re-selection may pick other entries
        return
    scale = float(p.abs().max())
    tol = (0.5 / 127 if QUANT_CASES[ci]["values"] == "int8" else 0.5 / 7) * scale * world
    assert float((q - p).abs().max()) <= tol + 1e-12


def test_ranks_on_different_value_formats_all_get_a_clear_error(quant):
    world, _, saved = quant
    for r in range(world):
        msg = saved[r]["mismatch"]
        assert msg is not None and msg.startswith(f"[rank {r}]") and "float32 as int8" in msg, msg
        assert torch.equal(saved[r]["after_mismatch"], torch.ones(1000) * world), "ranks out of sync after the error"


# -- config and checkpoint description ------------------------------------------------------------------

def test_values_key_lives_under_advanced_with_clear_errors():
    from ds_dragonn.config import DragonnConfig, DragonnConfigError
    cfg = DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "advanced": {"values": "int4"}}})
    assert cfg.values.value == "int4" and DragonnConfig().values.value == "auto"
    with pytest.raises(DragonnConfigError, match=r"'dragonn.advanced.values': invalid value 'int2'.*'int8'"):
        DragonnConfig.from_ds_config({"dragonn": {"advanced": {"values": "int2"}}})
    with pytest.raises(DragonnConfigError, match=r"'dragonn.values' belongs under 'advanced'"):
        DragonnConfig.from_ds_config({"dragonn": {"values": "int8"}})


def test_build_exchange_carries_the_format():
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.exchange import build_exchange
    from tests.exchange_cases import make_compressor
    for scheme in ("allgather", "partitioned"):
        cfg = DragonnConfig(enabled=True, exchange=scheme, advanced={"values": "int8"})
        ex = build_exchange(cfg, None, make_compressor("dragonn", 0.01))
        assert ex.values.bits == 8
        assert ex.max_bytes(1 << 20, 10_000, torch.bfloat16, 2) < \
            build_exchange(DragonnConfig(enabled=True, exchange=scheme), None,
                           make_compressor("dragonn", 0.01)).max_bytes(1 << 20, 10_000, torch.bfloat16, 2)


def test_a_changed_format_keeps_the_residuals_with_a_note():
    """The residuals are unsent gradients (the rounding included) in the same units: kept, the change logged."""
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.engine.state import compare
    desc = {"world_size": 2, "rank": 0, "bucketing": {}, "parameters": [], "exchange": "allgather"}
    dump = (lambda v: {**desc, "dragonn": DragonnConfig(enabled=True, advanced={"values": v}).model_dump(mode="json")})
    reset, fold, kept = compare(dump("int8"), dump("auto"))
    assert not reset and not fold and kept == ["dragonn.values int8 (now auto)"]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_gather_pairs_hands_back_what_every_rank_decodes_in_the_given_order(fmt):
    """Positions travel sorted (and a whole tail unsorted): ``sent`` maps back to the caller's order exactly."""
    from ds_dragonn.exchange.allgather import gather_pairs
    from tests.test_wire import CHUNK, ThreadGroup
    n, world = CHUNK + 10, 2
    tail = torch.arange(n - 4, n, dtype=torch.int32)
    heads = [torch.randperm(n - 4, generator=torch.Generator().manual_seed(r))[:101 + 30 * r].to(torch.int32)
             for r in range(world)]
    picks = [torch.cat([h, tail]) for h in heads]
    values = [torch.randn(p.numel(), generator=torch.Generator().manual_seed(9 + r)) for r, p in enumerate(picks)]
    counts = [p.numel() for p in picks]
    codec = value_codec(fmt)
    out = ThreadGroup(world).run(lambda r, b: gather_pairs(picks[r], values[r], counts, n, torch.int32,
                                                            torch.float32, b, whole=4, codec=codec))
    for r in range(world):
        sent = out[r].sent
        assert sent.numel() == counts[r] and not torch.equal(sent, values[r])
        for reader in range(world):
            idx, val = out[reader].indices[r], out[reader].values[r]
            got = torch.zeros(n).index_put_((idx.long(),), val)
            assert torch.equal(got[picks[r].long()], sent), f"rank {reader} decoded rank {r}'s list otherwise"
