"""The node-aware exchange (``hierarchy: node``): the layout from the launcher, the shard pipeline's
guarantees (nothing lost in float64, ranks bit-identical, density 1.0 the dense allreduce, 1/L of the flat
scheme's bytes per rank) at 2 and 3 nodes x 2 ranks, and engines at ZeRO 0-2 in both modes."""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.comm.topology import NodeLayout, check_layout, launcher_view
from ds_dragonn.config import DragonnConfig, DragonnConfigError
from ds_dragonn.exchange import HashedOwnership
from tests.hierarchy_cases import ENGINE_RUNS, PIPE_CASES, RESUME_RUNS, STEPS, grad
from tests.multiproc import ranks_fixture

WORLD, L = 4, 2
#: the launches this file shares (tests/multiproc.py)
POOL = "gloo"


# -- the layout ---------------------------------------------------------------------------------------------
def test_layout_groups():
    lay = NodeLayout(6, 2, 3)
    assert (lay.nodes, lay.node, lay.local_rank) == (3, 1, 1)
    assert lay.node_ranks(1) == [2, 3] and lay.cross_ranks(1) == [1, 3, 5] and str(lay) == "3 nodes x 2 ranks"


@pytest.mark.parametrize("views, override, size, words", [
    ([[2, 0], [2, 1], [2, 0], [2, 1]], None, 2, ""),
    ([[2, 0], [2, 1], [2, 0], [2, 1]], 4, None, "'advanced.ranks_per_node' 4 contradicts"),  # 2 per node
    ([[-2, -1]] * 4, None, None, "did not export"),  # a malformed LOCAL_SIZE
    ([[0, -1], [0, -1]], None, None, "did not export"),
    ([[0, -1], [0, -1], [0, -1], [0, -1]], 2, 2, ""),  # the override alone
    ([[2, 0], [3, 1], [3, 2]], None, None, "unequal nodes"),
    ([[2, 0], [2, 1], [2, 0]], None, None, "do not fill nodes"),
    ([[2, 1], [2, 0], [2, 0], [2, 1]], None, None, "not numbered node by node"),
])
def test_check_layout_agrees_or_names_why_not(views, override, size, words):
    got, why = check_layout(views, override)
    assert got == size and (words in why if words else why == "")


def test_launcher_view_reads_the_launchers_variables():
    assert launcher_view({"LOCAL_SIZE": "8", "LOCAL_RANK": "3"}) == (8, 3)
    assert launcher_view({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0"}) == (4, 0)  # torchrun
    assert launcher_view({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == (2, 1)
    assert launcher_view({}) == (None, None) and launcher_view({"LOCAL_SIZE": "x"}) == (None, None)
    assert launcher_view({"LOCAL_SIZE": "--2", "LOCAL_RANK": "-1"}) == (None, None)


@pytest.mark.parametrize("block, words", [({"hierarchy": "nodes"}, "hierarchy"),
                                          ({"advanced": {"ranks_per_node": 0}}, "ranks_per_node"),
                                          ({"hierarchy": "flat", "advanced": {"ranks_per_node": 2}}, "no effect"),
                                          ({"advanced": None}, "must be a JSON object"),
                                          ({"advanced": []}, "must be a JSON object"),
                                          ({"ranks_per_node": 2}, '"advanced": {"ranks_per_node": 2}'),
                                          ({"hierarchy": "flat", "sync": "local_steps",
                                            "advanced": {"ranks_per_node": 2}}, "no effect")])
def test_config_names_the_bad_value(block, words):
    with pytest.raises(DragonnConfigError, match=words):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, **block}})
    assert DragonnConfig(enabled=True).hierarchy.value == "auto"


# -- the shard pipeline, 2 nodes x 2 ranks --------------------------------------------------------------------
# (world size, every rank's record) of the pipeline cases at 2 and 3 nodes of L = 2 ranks
pipe_runs = ranks_fixture("tests.hierarchy_cases:pipeline_runs", "hpipe", worlds=[4, 6], ids=["2x2", "3x2"],
                          pool=POOL)


def test_the_launchers_local_size_gives_nodes_of_two(pipe_runs):
    world, runs = pipe_runs
    assert [r["layout"] for r in runs] == [(world // L, L, r // L, r % L) for r in range(world)]


@pytest.mark.parametrize("ci", range(len(PIPE_CASES)), ids=[f"{x}-{n}-{d}" for x, n, d in PIPE_CASES])
def test_nothing_lost_and_ranks_identical(pipe_runs, ci):
    """float64: Σ_t applied_t × P + every shard owner's residual (worker and server, at its bucket positions)
    == Σ_t Σ_ranks g_t; every rank applied the same."""
    exchange, n, density = PIPE_CASES[ci]
    per = -(-n // L)
    world, runs = pipe_runs
    runs = [r["cases"][ci]["node"] for r in runs]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run["applied"], runs[0]["applied"]))
    total = sum(grad(ci, r, s, n) for r in range(world) for s in range(STEPS))
    held = torch.zeros(per * L, dtype=torch.float64)
    for r, run in enumerate(runs):
        lo = (r % L) * per
        for res in run["residuals"].values():
            held[lo:lo + per] += res
        for srv in run["server"].values():  # the cross group's owner of these shard positions: rank r // L there
            own = HashedOwnership(per, world // L)
            held.index_add_(0, lo + own.to_index(r // L, torch.arange(srv.numel())), srv)
    applied = sum(runs[0]["applied"]) if n else torch.zeros(0, dtype=torch.float64)
    torch.testing.assert_close(applied * world + held[:n], total if n else applied, rtol=1e-11, atol=1e-10)
    assert float(held[n:].abs().sum()) == 0.0  # the padding never holds anything
    if n > 10 and density < 1.0:
        assert float(held.abs().sum()) > 0, "a sparse run must hold something back"


def test_density_one_is_the_dense_allreduce(pipe_runs):
    ci = next(i for i, c in enumerate(PIPE_CASES) if c[2] == 1.0)
    n = PIPE_CASES[ci][1]
    world, runs = pipe_runs
    for s, out in enumerate(runs[0]["cases"][ci]["node"]["applied"]):
        expect = sum(grad(ci, r, s, n) for r in range(world)) / world
        torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ci", [0, 1], ids=["allgather", "partitioned"])
def test_each_rank_sends_a_shard_not_a_bucket(pipe_runs, ci):
    """Each rank selects over 1/L of the bucket and exchanges only with the other nodes: it sends about 1/L of
    the flat scheme's bytes (a node's L ranks together one bucket's pairs, to the N - 1 other nodes only)."""
    n = PIPE_CASES[ci][1]
    for r in pipe_runs[1]:
        assert r["cases"][ci]["node"]["selected"] == [-(-n // L)] * STEPS  # selection work: the shard
        assert r["cases"][ci]["flat"]["selected"] == [n] * STEPS
        node, flat = sum(r["cases"][ci]["node"]["sent"]), sum(r["cases"][ci]["flat"]["sent"])
        assert 0 < node <= flat / L * 1.15, (node, flat)


# -- engines at ZeRO 0, 1 and 2, 2 nodes x 2 ranks -----------------------------------------------------------------------
engine_runs = ranks_fixture("tests.hierarchy_cases:engine_runs", "hengine", WORLD, timeout=600, pool=POOL)


@pytest.mark.parametrize("name", [n for n in ENGINE_RUNS if "dense" not in n])
def test_engines_train_node_aware_in_sync(engine_runs, name):
    for r in engine_runs:
        assert r[name]["layout"] == "2 nodes x 2 ranks"
        assert all(torch.equal(a, b) for a, b in zip(r[name]["params"], engine_runs[0][name]["params"]))
        assert all(bool(torch.isfinite(p).all()) for p in r[name]["params"])
    assert engine_runs[0][name]["telemetry"]["compressed_reductions"] > 0


@pytest.mark.parametrize("d1, dense", [("dense_d1", "dense"), ("zero2_d1", "zero2_dense")])
def test_density_one_engine_is_the_dense_engine(engine_runs, d1, dense):
    for r in engine_runs:
        for a, b in zip(r[d1]["params"], r[dense]["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


fold_runs = ranks_fixture("tests.hierarchy_cases:fold_runs", "hfold", WORLD, timeout=400, pool=POOL)


def test_a_node_aware_checkpoint_folds_or_resets_on_load(fold_runs):
    """Saved node-aware with the partitioned exchange: loaded node-aware with allgather, each rank's server
    residuals fold into its shard's worker residual at the positions it owned in its cross-node group (nothing
    lost: the same sum); loaded flat, the residuals (shards of node sums) reset with a warning naming the layout."""
    for rank, r in enumerate(fold_runs):
        assert r["before"] != 0.0 and r["server"]
        assert r["allgather"]["after"] == pytest.approx(r["before"], rel=1e-6, abs=1e-9)
        for key, srv in r["server"].items():  # at the positions this rank owns among the N ranks of its index
            per = r["worker"][key].numel()
            expect = r["worker"][key].clone()
            expect.index_add_(0, HashedOwnership(per, WORLD // L).to_index(rank // L, torch.arange(srv.numel())), srv)
            torch.testing.assert_close(r["allgather"]["residuals"][key], expect, rtol=1e-6, atol=1e-7)
        assert any("exchange partitioned" in n for n in r["allgather"]["notes"])
        assert r["flat"]["after"] == 0.0
        assert any("hierarchy 2 nodes x 2 ranks (now flat)" in n for n in r["flat"]["notes"]), r["flat"]["notes"]


resume_runs = ranks_fixture("tests.hierarchy_cases:resume_runs", "hresume", WORLD, timeout=600, pool=POOL)


@pytest.mark.parametrize("name", list(RESUME_RUNS))
def test_a_node_aware_resume_equals_the_uninterrupted_run(resume_runs, name):
    """Saved at step K and loaded by a fresh engine of the same layout: the same weights at 2K, bit for bit, on
    every rank, with the shards' residuals (and momenta) restored and nothing reset."""
    for r in resume_runs:
        run = r[name]
        assert run["layout"] == "2 nodes x 2 ranks" and run["notes"] == [], run["notes"]
        assert run["mass"] > 0 and run["loaded_mass"] == pytest.approx(run["mass"], rel=1e-12)
        assert all(torch.equal(a, b) for a, b in zip(run["params"], run["resumed"]))
