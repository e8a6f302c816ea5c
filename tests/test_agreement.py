"""Ranks started with different "dragonn" settings fail fast at initialize, on every rank, naming the field."""
from __future__ import annotations

import json

import pytest
import torch

from tests.dist_cases import DISAGREE
from tests.multiproc import run_ranks


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def runs(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"disagree{world}")
    run_ranks("tests.dist_cases:disagree_runs", world, out, timeout=300)
    return world, [torch.load(out / f"disagree_rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("name", list(DISAGREE))
def test_every_rank_names_the_field_and_each_value(runs, name):
    world, ranks = runs
    field = "zero_optimization.stage" if name == "zero_stage" else f"dragonn.{name}"
    for r in range(world):
        msg, seconds = ranks[r][name]
        assert msg is not None, f"rank {r} did not fail"
        assert msg.startswith(f"[rank {r}]") and f"{field}: rank 0: " in msg, msg
        values = [DISAGREE[name][min(q, 1)].get(name) for q in range(world)] if name != "zero_stage" else \
            [0] + [2] * (world - 1)
        for q, v in enumerate(values):
            assert f"rank {q}: {json.dumps(v)}" in msg, msg
        assert seconds < 60, "the mismatch must be reported within seconds, not after a collective timeout"


def test_ranks_that_agree_still_compress(runs):
    world, ranks = runs
    assert all(ranks[r]["agree_compressed"] == 1 for r in range(world))
