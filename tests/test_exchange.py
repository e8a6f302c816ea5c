"""The two exchange schemes over gloo at 2, 3 and 4 ranks: float64 reference, nothing lost, bytes.

``partitioned`` is checked against a float64 simulation of the same two-phase algorithm written here with
plain index ops (each rank selects from its compensated buffer; owners sum the pairs of their indices rank
by rank, re-select with their own seed, keep the rest as the server residual; everything decoded is
averaged). Both schemes are checked for the invariant that nothing is lost:
``P × Σ_steps applied + Σ_ranks worker residual + Σ_owners server residual == Σ_steps Σ_ranks gradient``.
"""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.exchange.ownership import HashedOwnership
from ds_dragonn.exchange.partitioned import owner_seed
from ds_dragonn.compress import max_pairs
from tests.exchange_cases import (SCHEME_CASES, SCHEME_STEPS, make_compressor, scheme_case_id, scheme_input)
from tests.multiproc import ranks_fixture

F64 = [i for i, c in enumerate(SCHEME_CASES) if c["dtype"] == torch.float64]


scheme_runs = ranks_fixture("tests.exchange_cases:scheme_cases", "scheme", timeout=400, worlds=[2, 3, 4],
                            ids=["2ranks", "3ranks", "4ranks"], pool="gloo")


@pytest.fixture(scope="module")
def schemes(scheme_runs):
    world, saved = scheme_runs
    return world, [s["results"] for s in saved], saved


def _step(ranks, ci, step, r):
    return ranks[r][ci][step]


SHARED = [i for i, c in enumerate(SCHEME_CASES) if c["exchange"] != "reduce_scatter"]


@pytest.mark.parametrize("ci", SHARED, ids=[scheme_case_id(SCHEME_CASES[i]) for i in SHARED])
def test_ranks_end_bit_identical(schemes, ci):
    world, ranks, _ = schemes
    for step in range(SCHEME_STEPS):
        outs = [_step(ranks, ci, step, r)["out"] for r in range(world)]
        for o in outs[1:]:
            assert o.dtype == outs[0].dtype and torch.equal(o.view(torch.uint8), outs[0].view(torch.uint8))


@pytest.mark.parametrize("ci", F64, ids=[scheme_case_id(SCHEME_CASES[i]) for i in F64])
def test_nothing_lost(schemes, ci):
    """Everything applied × P + all worker and server residuals == all raw gradients (float64 buckets)."""
    world, ranks, _ = schemes
    case = SCHEME_CASES[ci]
    n = case["numel"]
    raw = torch.zeros(n, dtype=torch.float64)
    applied = torch.zeros(n, dtype=torch.float64)
    for step in range(SCHEME_STEPS):
        if case["exchange"] == "reduce_scatter":  # each owner decodes its own slices only
            applied += sum(_step(ranks, ci, step, r)["out"] for r in range(world))
        else:
            applied += _step(ranks, ci, step, 0)["out"]
        for r in range(world):
            raw += scheme_input(ci, r, step, n, case["dtype"])
    held = torch.zeros(n, dtype=torch.float64)
    own = HashedOwnership(n, world)
    for r in range(world):
        last = _step(ranks, ci, SCHEME_STEPS - 1, r)
        held += last["residual"]
        if case["exchange"] == "partitioned":
            server = last["server"]
            assert server.numel() == own.size(r)
            held.index_add_(0, own.to_index(r, torch.arange(server.numel())), server)
        else:
            assert last["server"] is None
    total = applied * world + held
    torch.testing.assert_close(total, raw, rtol=1e-12, atol=1e-12 * (1 + float(raw.abs().max()) if n else 1))
    if n > 1 and case["density"] < 1:
        assert float(held.abs().sum()) > 0, "a sparse run must hold something back"


F64_SHARED = [i for i in F64 if i in SHARED]


@pytest.mark.parametrize("ci", F64_SHARED, ids=[scheme_case_id(SCHEME_CASES[i]) for i in F64_SHARED])
def test_dense_flush_sends_worker_and_server_residuals(schemes, ci):
    """A compressed → dense switch (reduce_dense) sends every worker and server residual: afterwards
    they are empty and everything applied × P equals all raw gradients, flush step included."""
    world, ranks, _ = schemes
    case = SCHEME_CASES[ci]
    n = case["numel"]
    raw = torch.zeros(n, dtype=torch.float64)
    applied = torch.zeros(n, dtype=torch.float64)
    for step in range(SCHEME_STEPS + 1):
        applied += _step(ranks, ci, step, 0)["out"]
        for r in range(world):
            raw += scheme_input(ci, r, step, n, case["dtype"])
    for r in range(world):
        flush = _step(ranks, ci, SCHEME_STEPS, r)
        assert torch.equal(flush["out"], _step(ranks, ci, SCHEME_STEPS, 0)["out"])
        assert not bool(flush["residual"].any())
        assert flush["server"] is None or not bool(flush["server"].any())
    torch.testing.assert_close(applied * world, raw, rtol=1e-12, atol=1e-12 * (1 + float(raw.abs().max()) if n else 1))


def _simulate(ci: int, world: int):
    """float64 two-phase reference: (outputs per step, worker residuals, server residuals) at the end."""
    case = SCHEME_CASES[ci]
    n = case["numel"]
    own = HashedOwnership(n, world)
    worker = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    server = [torch.zeros(own.size(o), dtype=torch.float64) for o in range(world)]
    comp = make_compressor(case["compressor"], case["density"])
    outs = []
    for step in range(SCHEME_STEPS):
        seed = 31 * step + 5
        for r in range(world):
            worker[r] += scheme_input(ci, r, step, n, case["dtype"])
            sel = comp.compress(worker[r], seed)
            idx = sel.indices.long()
            o_of, slot = own.owner_and_slot(idx)
            for o in range(world):
                m = o_of == o
                server[o].index_add_(0, slot[m], worker[r][idx[m]])
            worker[r][idx] = 0.0
        out = torch.zeros(n, dtype=torch.float64)
        for o in range(world):
            sel = comp.compress(server[o], owner_seed(seed, o))
            out.index_add_(0, own.to_index(o, sel.indices), sel.values)
            server[o][sel.indices.long()] = 0.0
        outs.append(out / world)
    return outs, worker, server


@pytest.mark.parametrize("ci", [i for i in F64 if SCHEME_CASES[i]["exchange"] == "partitioned"],
                         ids=[scheme_case_id(SCHEME_CASES[i]) for i in F64 if SCHEME_CASES[i]["exchange"] == "partitioned"])
def test_partitioned_matches_float64_two_phase_reference(schemes, ci):
    world, ranks, _ = schemes
    outs, worker, server = _simulate(ci, world)
    for step in range(SCHEME_STEPS):
        got = _step(ranks, ci, step, 0)["out"]
        scale = 1 + float(outs[step].abs().max()) if outs[step].numel() else 1
        torch.testing.assert_close(got, outs[step], rtol=1e-12, atol=1e-12 * scale)
    for r in range(world):
        last = _step(ranks, ci, SCHEME_STEPS - 1, r)
        torch.testing.assert_close(last["residual"], worker[r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(last["server"], server[r], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ci", [i for i, c in enumerate(SCHEME_CASES) if c["exchange"] == "reduce_scatter"],
                         ids=[scheme_case_id(c) for c in SCHEME_CASES if c["exchange"] == "reduce_scatter"])
def test_reduce_scatter_owners_get_only_their_slices(schemes, ci):
    """Each rank decodes only positions it owns; their union over ranks is the allgather's sum (float64)."""
    from ds_dragonn.exchange.reduce_scatter import RangeOwnership
    from tests.exchange_cases import zero_like_ranges
    world, ranks, _ = schemes
    case = SCHEME_CASES[ci]
    n = case["numel"]
    own = RangeOwnership(n, zero_like_ranges(n, world), world)
    owner = own.owner_and_slot(torch.arange(n))[0]
    for step in range(SCHEME_STEPS):
        for r in range(world):
            st = _step(ranks, ci, step, r)
            assert not bool(st["out"][owner != r].any()), "a rank decoded a slice it does not own"
            assert st["stats"]["dense_bytes"] == (world - 1) * n * case["dtype"].itemsize // world


def test_ranks_on_different_schemes_all_get_a_clear_error(schemes):
    """Rank 0 partitioned, the others allgather: the same BufferMismatchError on every rank (no crash in a
    collective of unequal size, no hang), and the next reduction works."""
    world, _, saved = schemes
    for r in range(world):
        msg = saved[r]["scheme_mismatch"]
        assert msg is not None and msg.startswith(f"[rank {r}]") and "'dragonn.exchange'" in msg, msg
        assert "rank 0: partitioned" in msg and f"rank {world - 1}: allgather" in msg, msg
        assert torch.equal(saved[r]["after_mismatch"], torch.ones(1000) * world), "ranks out of sync after the error"


def _pairs_equivalent(stats, case) -> float:
    # allgather: a 16-bit packed position + value (buffers here are one 65 536-element chunk);
    # partitioned: phase 1's int32 slots (phase 2's packed positions are cheaper: an upper count)
    pair = (2 if case["exchange"] == "allgather" else 4) + case["dtype"].itemsize
    return stats["bytes_sent"] / pair


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_partitioned_bytes_bounded_and_below_allgather(schemes, dtype):
    """At density 0.01 partitioned sends ≤ 3k(P−1)/P pairs-equivalent per rank; allgather sends (P−1)·k."""
    world, ranks, _ = schemes
    find = {(c["exchange"], c["numel"], c["dtype"], c["density"], c.get("ties", False)): i
            for i, c in enumerate(SCHEME_CASES)}
    part = find[("partitioned", 20_011, dtype, 0.01, False)]
    gath = find[("allgather", 20_011, dtype, 0.01, False)]
    for r in range(world):
        for step in range(SCHEME_STEPS):
            p, g = _step(ranks, part, step, r)["stats"], _step(ranks, gath, step, r)["stats"]
            k = p["k"]
            assert 0 < _pairs_equivalent(p, SCHEME_CASES[part]) <= 3 * k * (world - 1) / world
            assert _pairs_equivalent(g, SCHEME_CASES[gath]) >= 0.8 * (world - 1) * k
            assert p["bytes_received"] > 0 and p["imbalance"] >= 1.0
            if world >= 3:
                assert p["bytes_sent"] < g["bytes_sent"]


@pytest.mark.parametrize("ci", range(len(SCHEME_CASES)), ids=[scheme_case_id(c) for c in SCHEME_CASES])
def test_bytes_within_the_exchange_bound(schemes, ci):
    """Bounded bytes: no rank sends more than ``max_pairs(k) ≈ 1.1 k`` pairs, ties included, so the bytes stay
    within the exchange's ``max_bytes`` (the bound the engine compares with dense)."""
    world, ranks, _ = schemes
    case = SCHEME_CASES[ci]
    for r in range(world):
        for step in range(SCHEME_STEPS):
            st = _step(ranks, ci, step, r)["stats"]
            assert st["kept"] <= max_pairs(st["k"])
            assert st["bytes_sent"] <= st["max_bytes"], (st["bytes_sent"], st["max_bytes"])
            if case.get("ties") and case["exchange"] != "reduce_scatter" and world == 2:
                # all ±1 used to fill DRAGONN's table: 4k pairs; now ~1.1k (allgather: k pairs + header)
                pair = 4 + case["dtype"].itemsize
                assert st["bytes_sent"] <= (world - 1) * (1.1 * st["k"] + 16) * pair * (2 if case["exchange"] == "partitioned" else 1) + 200


class _FakeGroup:
    """rank/world only: load_state_dict runs no collective."""

    def __init__(self, rank, world):
        self.rank, self.world_size = rank, world


def _state_of(world: int, rank: int, numel: int, length=None) -> dict:
    from ds_dragonn.exchange import PartitionedExchange
    ex = PartitionedExchange(_FakeGroup(rank, world), make_compressor("dragonn", 0.01))
    size = HashedOwnership(numel, world).size(rank) if length is None else length
    ex.server.residuals["b"] = torch.arange(float(size))
    ex._numel["b"] = numel
    return ex.state_dict()


def test_server_residuals_of_another_owner_are_dropped_with_a_warning(caplog):
    """Saved at 3 ranks, loaded at 4 (rank 1 of n=10 owns 3 indices either way): dropped, never reused."""
    from ds_dragonn.exchange import PartitionedExchange
    ex = PartitionedExchange(_FakeGroup(1, 4), make_compressor("dragonn", 0.01))
    with caplog.at_level("WARNING"):
        ex.load_state_dict(_state_of(3, 1, 10))
    assert ex.server.residuals == {} and "saved by rank 1 of 3" in caplog.text and "rank 1 of 4" in caplog.text
    same = PartitionedExchange(_FakeGroup(1, 3), make_compressor("dragonn", 0.01))
    same.load_state_dict(_state_of(3, 1, 10))
    assert torch.equal(same.server.residuals["b"], torch.arange(3.0))


def test_server_residual_of_the_wrong_length_is_refused():
    from ds_dragonn.exchange import PartitionedExchange
    ex = PartitionedExchange(_FakeGroup(0, 3), make_compressor("dragonn", 0.01))
    with pytest.raises(ValueError, match=r"server residual for bucket 'b' has shape \(7,\).*gives rank 0 20 indices"):
        ex.load_state_dict(_state_of(3, 0, 60, length=7))
    assert ex.server.residuals == {}


def test_hook_state_of_another_rank_is_not_loaded(caplog):
    """engine.dragonn.load_state_dict of rank 0's state on rank 1 (DeepSpeed's client_state trap): warned, not applied."""
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.engine.base import HookBase
    from ds_dragonn.pipeline import CompressedAllreduce

    from tests.fakes import fake_engine
    engine = fake_engine()

    def hook(rank, world):
        h = HookBase(engine, DragonnConfig(enabled=True))
        h._pipelines[0] = CompressedAllreduce(h.compressor, _FakeGroup(rank, world), h.error_feedback)
        return h

    src = hook(0, 2)
    src.error_feedback.residuals["b"] = torch.ones(5)
    state = src.state_dict()
    assert (state["rank"], state["world_size"]) == (0, 2)
    other = hook(1, 2)
    other.error_feedback.residuals["b"] = torch.full((5,), 7.0)
    with caplog.at_level("WARNING"):
        other.load_state_dict(state)
    assert other.error_feedback.residuals == {} and "rank 0 (now 1)" in caplog.text
    same = hook(0, 2)
    same.load_state_dict(state)
    assert torch.equal(same.error_feedback.residuals["b"], torch.ones(5))


def test_fp16_sums_beyond_the_fp16_range_stay_finite(schemes):
    """fp16 gradients whose sum over ranks exceeds 65504 while their mean does not (4 ranks of 30000.0):
    both exchanges give the mean (float64 reference, within fp16 rounding), finite, bit-identical to each
    other and on every rank. (Summed in fp16 the allgather decode gave Inf; the partitioned owner clamped its
    sum to 65504 and gave 65504/P.)"""
    from tests.exchange_cases import fp16_limit_input
    world, _, saved = schemes
    for case in (0, 1):
        mean = sum(fp16_limit_input(case, r).double() for r in range(world)) / world
        outs = {x: [s["fp16_limit"][x][case] for s in saved] for x in ("allgather", "partitioned")}
        for x, per_rank in outs.items():
            got = per_rank[0]
            assert got.dtype == torch.float16 and bool(torch.isfinite(got).all()), (x, case)
            torch.testing.assert_close(got.double(), mean, rtol=1e-3, atol=0, msg=f"{x} case {case}")
            assert all(torch.equal(o, got) for o in per_rank[1:]), (x, case)
        assert torch.equal(outs["allgather"][0], outs["partitioned"][0]), case
