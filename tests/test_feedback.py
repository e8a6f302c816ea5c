"""Error feedback: nothing lost (sent + residual == compensated input, exactly), over several steps."""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.compress import DragonnCompressor, RandomKCompressor, TopKCompressor
from ds_dragonn.feedback import ErrorFeedback, residual_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 7, 4099, 100_003])
@pytest.mark.parametrize("make", [lambda: DragonnCompressor(0.01, min_sample=64), lambda: TopKCompressor(0.05),
                                  lambda: RandomKCompressor(0.05)])
def test_sent_plus_residual_equals_compensated(dtype, n, make):
    comp, ef = make(), ErrorFeedback()
    prev = torch.zeros(n, dtype=residual_dtype(dtype))
    for step in range(4):
        g = torch.randn(n).to(dtype)
        compensated = ef.compensate("b", g)
        assert compensated.dtype == residual_dtype(dtype)
        # independent reference of compensation, in float64
        torch.testing.assert_close(compensated, (g.double() + prev.double()).to(compensated.dtype))
        expect = compensated.clone()
        sel = comp.compress(compensated, step)
        wire = sel.values.to(dtype)
        res = ef.update("b", compensated, sel.indices, wire)
        sent = torch.zeros(n, dtype=residual_dtype(dtype))
        sent[sel.indices.long()] = wire.to(sent.dtype)
        assert torch.equal(sent + res, expect)  # exactly: nothing lost
        untouched = torch.ones(n, dtype=torch.bool)
        untouched[sel.indices.long()] = False
        assert torch.equal(res[untouched], expect[untouched])
        prev = res.clone()


def test_non_finite_never_stays_in_residual():
    ef = ErrorFeedback()
    g = torch.randn(1000)
    g[3], g[500] = float("nan"), float("inf")
    c = ef.compensate("b", g)
    sel = DragonnCompressor(0.01).compress(c, 0)
    res = ef.update("b", c, sel.indices, sel.values)
    assert bool(torch.isfinite(res).all())
    assert {3, 500} <= set(sel.indices.tolist())


def test_disabled_keeps_nothing():
    ef = ErrorFeedback(enabled=False)
    g = torch.randn(100)
    c = ef.compensate("b", g)
    assert ef.update("b", c, torch.tensor([1]), c[1:2]) is None and ef.residuals == {}
    assert torch.equal(ef.compensate("b", g), g)


def test_state_dict_round_trip_and_shape_check():
    ef = ErrorFeedback()
    c = ef.compensate("b", torch.randn(10))
    ef.update("b", c, torch.tensor([0]), c[:1])
    other = ErrorFeedback()
    other.load_state_dict(ef.state_dict())
    assert torch.equal(other.residuals["b"], ef.residuals["b"])
    with pytest.raises(ValueError, match="shape"):
        other.compensate("b", torch.randn(11))
