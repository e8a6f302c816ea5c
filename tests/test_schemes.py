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
from tests.dist_cases import (SCHEME_CASES, SCHEME_STEPS, make_compressor, scheme_case_id, scheme_input)
from tests.multiproc import run_ranks

F64 = [i for i, c in enumerate(SCHEME_CASES) if c["dtype"] == torch.float64]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["2ranks", "3ranks", "4ranks"])
def schemes(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"schemes{world}")
    run_ranks("tests.dist_cases:scheme_cases", world, out, timeout=400)
    return world, [torch.load(out / f"scheme_rank{r}.pt", weights_only=False) for r in range(world)]


def _step(ranks, ci, step, r):
    return ranks[r][ci][step]


@pytest.mark.parametrize("ci", range(len(SCHEME_CASES)), ids=[scheme_case_id(c) for c in SCHEME_CASES])
def test_ranks_end_bit_identical(schemes, ci):
    world, ranks = schemes
    for step in range(SCHEME_STEPS):
        outs = [_step(ranks, ci, step, r)["out"] for r in range(world)]
        for o in outs[1:]:
            assert o.dtype == outs[0].dtype and torch.equal(o.view(torch.uint8), outs[0].view(torch.uint8))


@pytest.mark.parametrize("ci", F64, ids=[scheme_case_id(SCHEME_CASES[i]) for i in F64])
def test_nothing_lost(schemes, ci):
    """Everything applied × P + all worker and server residuals == all raw gradients (float64 buckets)."""
    world, ranks = schemes
    case = SCHEME_CASES[ci]
    n = case["numel"]
    raw = torch.zeros(n, dtype=torch.float64)
    applied = torch.zeros(n, dtype=torch.float64)
    for step in range(SCHEME_STEPS):
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


@pytest.mark.parametrize("ci", F64, ids=[scheme_case_id(SCHEME_CASES[i]) for i in F64])
def test_dense_flush_sends_worker_and_server_residuals(schemes, ci):
    """A compressed → dense switch (reduce_dense) sends every worker and server residual: afterwards
    they are empty and everything applied × P equals all raw gradients, flush step included."""
    world, ranks = schemes
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
    world, ranks = schemes
    outs, worker, server = _simulate(ci, world)
    for step in range(SCHEME_STEPS):
        got = _step(ranks, ci, step, 0)["out"]
        scale = 1 + float(outs[step].abs().max()) if outs[step].numel() else 1
        torch.testing.assert_close(got, outs[step], rtol=1e-12, atol=1e-12 * scale)
    for r in range(world):
        last = _step(ranks, ci, SCHEME_STEPS - 1, r)
        torch.testing.assert_close(last["residual"], worker[r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(last["server"], server[r], rtol=1e-12, atol=1e-12)


def _pairs_equivalent(stats, case) -> float:
    pair = (4 + case["dtype"].itemsize)
    return stats["bytes_sent"] / pair


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_partitioned_bytes_bounded_and_below_allgather(schemes, dtype):
    """At density 0.01 partitioned sends ≤ 3k(P−1)/P pairs-equivalent per rank; allgather sends (P−1)·k."""
    world, ranks = schemes
    find = {(c["exchange"], c["numel"], c["dtype"], c["density"]): i for i, c in enumerate(SCHEME_CASES)}
    part = find[("partitioned", 20_011, dtype, 0.01)]
    gath = find[("allgather", 20_011, dtype, 0.01)]
    for r in range(world):
        for step in range(SCHEME_STEPS):
            p, g = _step(ranks, part, step, r)["stats"], _step(ranks, gath, step, r)["stats"]
            k = p["k"]
            assert 0 < _pairs_equivalent(p, SCHEME_CASES[part]) <= 3 * k * (world - 1) / world
            assert _pairs_equivalent(g, SCHEME_CASES[gath]) >= 0.8 * (world - 1) * k
            assert p["bytes_received"] > 0 and p["imbalance"] >= 1.0
            if world >= 3:
                assert p["bytes_sent"] < g["bytes_sent"]
