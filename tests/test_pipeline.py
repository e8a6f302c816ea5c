"""Compressed allreduce over gloo with 2 and 3 ranks, checked against a float64 reference.

Every rank's inputs are regenerated here from their seeds; the reference is computed in float64 from the
inputs and the residuals alone (decoded sum = scale × Σ_r (compensated_r − residual_r)), and the residual
itself is pinned independently: at every position either nothing was sent (residual == compensated) or
the compensated value rounded to the wire dtype was sent.
"""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.compress import target_k
from ds_dragonn.feedback import residual_dtype
from tests.pipeline_cases import EXCHANGE_CASES, SCALE, STEPS, case_id, rank_input
from tests.multiproc import ranks_fixture


exchanged = ranks_fixture("tests.pipeline_cases:exchange_cases", "exchange", timeout=240, worlds=[2, 3],
                          ids=["2ranks", "3ranks"], pool="gloo")


@pytest.mark.parametrize("ci", range(len(EXCHANGE_CASES)), ids=[case_id(c) for c in EXCHANGE_CASES])
def test_matches_float64_reference(exchanged, ci):
    world, ranks = exchanged
    case = EXCHANGE_CASES[ci]
    n, dtype = case["numel"], case["dtype"]
    rdt = residual_dtype(dtype)
    prev = [torch.zeros(n, dtype=rdt) for _ in range(world)]
    for step in range(STEPS):
        outs = [ranks[r]["results"][ci][step]["out"] for r in range(world)]
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), "ranks must end bit-identical"
        total = torch.zeros(n, dtype=torch.float64)
        for r in range(world):
            x = rank_input(ci, r, step, n, dtype)
            compensated = x.to(rdt) + prev[r]
            res = ranks[r]["results"][ci][step]["residual"]
            assert res.dtype == rdt
            sent = compensated - res
            was_sent = res != compensated
            # sent positions carry the compensated value rounded to the wire dtype, the rest is zero
            assert torch.equal(sent[was_sent], compensated[was_sent].to(dtype).to(rdt))
            stats = ranks[r]["results"][ci][step]["stats"]
            assert int(was_sent.sum()) <= stats["kept"] <= stats["capacity"]
            if case["density"] == 1.0 and case["compressor"] == "dragonn":
                assert torch.equal(res, compensated - compensated.to(dtype).to(rdt))  # everything sent
            total += sent.double()
            prev[r] = res
        expect = (total * SCALE)
        tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(outs[0].double(), expect, rtol=tol, atol=tol * (1 + (float(expect.abs().max()) if n else 0.0)))


@pytest.mark.parametrize("ci", [i for i, c in enumerate(EXCHANGE_CASES) if c["numel"] >= 65_537 and c["density"] < 1],
                         ids=[case_id(c) for c in EXCHANGE_CASES if c["numel"] >= 65_537 and c["density"] < 1])
def test_sends_fewer_bytes_than_dense(exchanged, ci):
    world, ranks = exchanged
    for r in range(world):
        stats = ranks[r]["results"][ci][-1]["stats"]
        assert stats["k"] == target_k(EXCHANGE_CASES[ci]["numel"], 0.01)
        assert stats["dense_bytes"] == 2 * (world - 1) * stats["numel"] * EXCHANGE_CASES[ci]["dtype"].itemsize // world
        assert 0 < stats["bytes_sent"] < 0.06 * stats["dense_bytes"]


def test_disagreeing_ranks_all_get_a_clear_error(exchanged):
    world, ranks = exchanged
    for r in range(world):
        msg = ranks[r]["mismatch"]
        assert msg is not None and f"rank {r}" in msg and "disagree" in msg and "10 x float32" in msg
        assert ranks[r]["residual_kept"], "a failed exchange must leave the residual untouched"
