"""``sync: local_steps`` with ``hierarchy: node``: each node is one DiLoCo worker (engine/local_nodes.py), at 2
nodes x 2 ranks. Between syncs a node's ranks step alike (their gradients averaged inside the node) while the
nodes drift apart, and no collective crosses nodes; every outer step leaves all ranks bit-identical, at density
1.0 on the float64 mean of the nodes' pseudo-gradients; nothing is lost; the traffic is counted on the right
link; one SGD step per round is dense training; a resume is exact, and a resume flat restarts from θ_outer."""
from __future__ import annotations

import math

import pytest
import torch

from ds_dragonn.config import DragonnConfig
from ds_dragonn.exchange.wire import dense_allreduce_bytes
from tests.local_nodes_cases import KEPT, L, RUNS
from tests.multiproc import ranks_fixture

WORLD, WARMUP = 4, 2


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_config_accepts_the_node_hierarchy_with_local_steps_and_zero_1_2_stay_refused():
    from ds_dragonn.plan import DragonnUnsupportedError, Facts, check
    block = {"enabled": True, "sync": "local_steps", "hierarchy": "node", "advanced": {"ranks_per_node": 2}}
    cfg = DragonnConfig.from_ds_config({"dragonn": block})
    assert cfg.hierarchy.value == "node" and cfg.sync.value == "local_steps" and cfg.ranks_per_node == 2
    check(cfg, Facts.from_ds_config({"zero_optimization": {"stage": 0}}), "start")
    for stage in (1, 2):
        with pytest.raises(DragonnUnsupportedError, match=f"ZeRO stage {stage}"):
            check(cfg, Facts.from_ds_config({"zero_optimization": {"stage": stage}}), "start")


ranks = ranks_fixture("tests.local_nodes_cases:node_rounds", "lnodes", WORLD, timeout=500)


@pytest.mark.parametrize("name", list(RUNS))
def test_a_nodes_ranks_step_alike_and_the_nodes_apart_until_each_outer_step(ranks, name):
    runs = [r["rounds"][name] for r in ranks]
    assert all(run["layout"] == "2 nodes x 2 ranks" for run in runs)
    steps = runs[0]["per_step"]
    syncs = [i for i, s in enumerate(steps) if s["rounds"] != (steps[i - 1]["rounds"] if i else 0)]
    assert syncs == [4, 7], syncs  # steps 5 and 8
    for i in range(len(steps)):
        w = [run["per_step"][i]["weights"] for run in runs]
        assert _same(w[0], w[1]) and _same(w[2], w[3]), (name, i + 1)  # one node, one replica
        if i < WARMUP or (i in syncs and name not in KEPT):
            assert _same(w[0], w[2]), (name, i + 1)  # the warm-up, and every outer step: all ranks alike
        else:
            assert not _same(w[0], w[2]), (name, i + 1)  # two workers between syncs


@pytest.mark.parametrize("name", list(RUNS))
def test_outer_lr_auto_counts_the_nodes_as_the_workers(ranks, name):
    """2 nodes x 2 ranks: the workers are the 2 nodes, not the 4 ranks; "auto" is √2, at least 2 for a
    compressed Δ."""
    block = RUNS[name][0]
    given = block.get("outer_lr", "auto")
    auto = math.sqrt(2) if block["density"] >= 1.0 else 2.0
    assert all(r["rounds"][name]["workers"] == 2 for r in ranks)
    assert all(r["rounds"][name]["outer_lr"] == (auto if given == "auto" else given) for r in ranks)


@pytest.mark.parametrize("name", list(RUNS))
def test_no_collective_crosses_nodes_between_syncs(ranks, name):
    """Clipping (1.0) and the overflow check stay local; a local step runs one allreduce, inside the node."""
    for r in ranks:
        steps = r["rounds"][name]["per_step"]
        assert steps[0]["cross"] > 0 and steps[1]["cross"] > 0  # the dense warm-up, over every rank
        assert steps[2]["cross"] == 1 and steps[2]["node"] == 1  # θ_outer from rank 0's weights, once
        for i in (3, 5, 6):
            assert (steps[i]["cross"], steps[i]["node"]) == (0, 1), (name, i + 1, steps[i])
        assert steps[4]["cross"] > 0 and steps[7]["cross"] > 0  # the outer steps


def test_a_dense_outer_step_applies_the_mean_of_the_nodes_pseudo_gradients(ranks):
    """density 1.0, outer lr 0.7: θ_outer ← θ_outer − 0.7 · mean over nodes (θ_outer − θ_node), in float64 from
    what each node held before the step."""
    lr = RUNS["dense_delta"][0]["outer_lr"]
    runs = [r["rounds"]["dense_delta"]["outer"] for r in ranks]
    assert len(runs[0]) == 2
    for i in range(len(runs[0])):
        anchor = runs[0][i]["anchor"]
        nodes = [runs[node * L][i]["masters"] for node in range(WORLD // L)]
        assert not torch.equal(nodes[0], nodes[1])
        expect = anchor - lr * sum(anchor - theta for theta in nodes) / len(nodes)
        for run in runs:
            torch.testing.assert_close(run[i]["after"], expect, rtol=1e-6, atol=1e-6)


def _assert_nothing_lost(runs, kept: bool) -> None:
    """The shards' residuals (placed in the node's sum, summed over ranks) equal Σ_rounds (Σ_ranks own progress −
    P·Δ̄); own progress is Δ, minus what the node's weights held back after the round before when ``kept``."""
    n = runs[0]["numel"]
    per = -(-n // L)
    expected = torch.zeros(n, dtype=torch.float64)
    for i in range(len(runs[0]["applied"])):
        own = [run["delta"][i] - (_node_kept(runs, rank // L, i - 1, n).double() if kept and i else 0.0)
               for rank, run in enumerate(runs)]
        expected += sum(own) - WORLD * runs[0]["applied"][i]
    held = torch.zeros(per * L, dtype=torch.float64)
    for rank, run in enumerate(runs):
        (res,) = run["residuals"]
        held[(rank % L) * per:(rank % L + 1) * per] += res
    assert float(held.abs().sum()) > 0
    torch.testing.assert_close(held[:n], expected, rtol=1e-5, atol=1e-5)


def _node_kept(runs, node: int, i: int, n: int) -> torch.Tensor:
    """What node ``node``'s weights hold back after sync ``i``: its L shard residuals gathered, over L (fp32)."""
    return torch.cat([runs[node * L + j]["kept"][i] for j in range(L)])[:n] / L


def test_kept_weights_are_theta_outer_minus_the_nodes_residual(ranks):
    """``outer_residual: weights`` node-aware: after every sync θ_outer is bit-identical on every rank, a node's
    ranks hold the same weights, and these are exactly θ_outer − (the node's gathered shard residuals) / L."""
    runs = [r["rounds"]["kept_fp32"] for r in ranks]
    n = runs[0]["numel"]
    for i in range(len(runs[0]["anchors"])):
        for rank, run in enumerate(runs):
            assert torch.equal(run["anchors"][i], runs[0]["anchors"][i])
            assert torch.equal(run["masters"][i], run["anchors"][i] - _node_kept(runs, rank // L, i, n)), (rank, i)
    assert not torch.equal(runs[0]["masters"][-1], runs[L]["masters"][-1])


def test_kept_nothing_lost_over_the_rounds(ranks):
    """float64: with the unsent Δ in the weights, a round's own progress is Δ minus what the node held back; the
    shards' residuals equal Σ_rounds (Σ_ranks own progress − P·Δ̄)."""
    _assert_nothing_lost([r["rounds"]["kept_fp32"] for r in ranks], kept=True)


@pytest.mark.parametrize("name", list(RUNS))
def test_the_node_traffic_is_counted_on_the_fast_link(ranks, name):
    """Local steps: an fp32 allreduce inside the node each, in ``node_bytes_sent``, nothing across nodes; the outer
    steps send one shard per rank across nodes."""
    for r in ranks:
        run = r["rounds"][name]
        t, n, size = run["telemetry"], run["numel"], run["itemsize"]
        local = run["steps"] - WARMUP
        assert t["local_steps_taken"] == local and t["outer_syncs"] == 2
        assert t["node_bytes_sent"] == local * dense_allreduce_bytes(n, 4, L)
        assert t["bytes_sent"] == WARMUP * dense_allreduce_bytes(n, size, WORLD) + t["outer_bytes_sent"]
        shard = dense_allreduce_bytes(-(-n // L), size, WORLD // L)
        if RUNS[name][0]["density"] == 1.0:
            assert t["outer_bytes_sent"] == 2 * shard
        else:
            assert 0 < t["outer_bytes_sent"] < 2 * shard


def test_one_sgd_step_per_round_is_dense_training(ranks):
    """SGD, density 1.0, H = 1, outer lr 1: the mean over nodes of the mean inside each node is the mean over
    every rank, the dense engine's step (up to fp32 rounding of θ − (θ − lr·g))."""
    for r in ranks:
        for a, b in zip(r["sgd"]["node"], r["sgd"]["dense"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_resume_mid_round_is_exact(ranks):
    for r in ranks:
        run = r["resume"]
        assert run["notes"] == [] and _same(run["straight"], run["resumed"]) and _same(run["anchor"],
                                                                                         run["anchor_resumed"])


def test_a_resume_on_another_layout_restarts_every_rank_from_theta_outer(ranks):
    """Saved node-aware mid-round, loaded flat by the same 4 ranks: a layout change is handled as a world-size
    change (every rank ← θ_outer, the round count kept, a warning naming it), and the next sync leaves θ_outer
    bit-identical on every rank."""
    for r in ranks:
        saved, flat = r["resume"]["saved"], r["resume"]["flat"]
        assert flat["layout"] is None and flat["rounds"] == saved["rounds"] == 1 and flat["rounds_after"] == 2
        assert _same(flat["weights"], [a.view_as(w) for a, w in zip(saved["anchor"], flat["weights"])])
        assert not _same(saved["weights"], flat["weights"])
        text = " ".join(flat["notes"])
        assert "hierarchy 2 nodes x 2 ranks (now flat)" in text and "θ_outer" in text, text
    assert all(_same(r["resume"]["flat"]["after"], ranks[0]["resume"]["flat"]["after"]) for r in ranks[1:])
