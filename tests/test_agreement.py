"""Ranks started with different "dragonn" settings fail fast at initialize, on every rank, naming the field."""
from __future__ import annotations

import json

import pytest

from tests.agreement_cases import AGREE_ANYWAY, DISAGREE, REFUSED_ON_ONE_RANK
from tests.multiproc import ranks_fixture


runs = ranks_fixture("tests.agreement_cases:disagree_runs", "disagree", timeout=300, worlds=[2, 3],
                     ids=["2ranks", "3ranks"], pool="gloo")


def _get(block: dict, dotted: str):
    for key in dotted.split("."):
        block = block.get(key)
    return block


@pytest.mark.parametrize("name", list(DISAGREE))
def test_every_rank_names_the_field_and_each_value(runs, name):
    world, ranks = runs
    field = {"zero_stage": "zero_optimization.stage",
             "gradient_accumulation_steps": "gradient_accumulation_steps"}.get(name, f"dragonn.{name}")
    for r in range(world):
        kind, msg, seconds = ranks[r][name]
        assert kind == "DragonnConfigMismatchError", (kind, msg)
        assert msg.startswith(f"[rank {r}]") and f"{field}: rank 0: " in msg, msg
        values = {"zero_stage": [0] + [2] * (world - 1),
                  "gradient_accumulation_steps": [1] + [2] * (world - 1)}.get(
            name, [_get(DISAGREE[name][min(q, 1)], name) for q in range(world)])
        for q, v in enumerate(values):
            assert f"rank {q}: {json.dumps(v)}" in msg, msg
        assert seconds < 60, "the mismatch must be reported within seconds, not after a collective timeout"
        if name.startswith("advanced."):  # named once, where the key is written (not as a top-level view)
            assert f"dragonn.{name.split('.', 1)[1]}: " not in msg, msg


@pytest.mark.parametrize("name", list(REFUSED_ON_ONE_RANK))
def test_a_refusal_on_one_rank_stops_every_rank(runs, name):
    """The refusing rank raises its own error, the others a mismatch error naming it: nobody hangs."""
    world, ranks = runs
    kind, msg, seconds = ranks[0][name]
    assert kind == "DragonnConfigMismatchError" and "rank 1 refused its DRAGONN configuration" in msg, msg
    own = {"invalid_key": ("DragonnConfigError", "densty"), "offload": ("DragonnUnsupportedError", "offload_optimizer")}
    for r in range(1, world):
        kind, msg, seconds = ranks[r][name]
        assert (kind, own[name][1] in msg) == (own[name][0], True), (kind, msg)
    assert all(ranks[r][name][2] < 60 for r in range(world))


@pytest.mark.parametrize("name", list(AGREE_ANYWAY))
def test_differences_that_change_no_collective_are_accepted(runs, name):
    world, ranks = runs
    assert all(ranks[r][name][0] is None for r in range(world)), [ranks[r][name] for r in range(world)]


def test_ranks_that_agree_still_compress(runs):
    world, ranks = runs
    assert all(ranks[r]["agree_compressed"] == 1 for r in range(world))


def test_ranks_training_different_parameters_fail_on_every_rank(runs):
    """Same bucket length, different parameters (rank 0 froze b, the others a): a clear error, no silent mix."""
    world, ranks = runs
    for r in range(world):
        msg = ranks[r]["layout_mismatch"]
        assert msg is not None and msg.startswith(f"[rank {r}]") and "bucket layout" in msg, msg
