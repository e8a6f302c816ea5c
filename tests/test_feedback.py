"""Error feedback: nothing lost (sent + residual == compensated input, exactly), over several steps."""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.compress import DragonnCompressor
from launch.bench.baselines import RandomKCompressor, TopKCompressor
from ds_dragonn.feedback import ErrorFeedback, residual_dtype


def _shapes(n):
    """Split n elements into a bucket of awkward tensor shapes (as DeepSpeed hands them over)."""
    if n < 10:
        return [(n,)]
    a = n // 3
    return [(a // 2, 2), (1,), (n - a - 1 - 2 * (a // 2),), (a,)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 7, 4099, 100_003])
@pytest.mark.parametrize("make", [lambda: DragonnCompressor(0.01, min_sample=64), lambda: TopKCompressor(0.05),
                                  lambda: RandomKCompressor(0.05)])
@pytest.mark.parametrize("prescale", [1.0, 0.3])
def test_sent_plus_residual_equals_compensated(dtype, n, make, prescale):
    comp, ef = make(), ErrorFeedback()
    prev = torch.zeros(n, dtype=residual_dtype(dtype))
    shapes = _shapes(n)
    for step in range(4):
        g = torch.randn(n).to(dtype)
        bucket, off = [], 0
        for s in shapes:
            size = int(torch.Size(s).numel())
            bucket.append(g[off:off + size].view(s).clone())
            off += size
        compensated = ef.compensate_("b", bucket, dtype, prescale)
        assert compensated.dtype == residual_dtype(dtype) and compensated.shape == (n,)
        # independent reference of compensation, in float64
        torch.testing.assert_close(compensated, (g.double() * prescale + prev.double()).to(compensated.dtype))
        expect = compensated.clone()
        sel = comp.compress(compensated, step)
        wire = sel.values.to(dtype)
        ef.commit("b", sel.indices, sel.values, wire)
        res = ef.residuals["b"]
        sent = torch.zeros(n, dtype=residual_dtype(dtype))
        sent[sel.indices.long()] = wire.to(sent.dtype)
        assert torch.equal(sent + res, expect)  # exactly: nothing lost
        untouched = torch.ones(n, dtype=torch.bool)
        untouched[sel.indices.long()] = False
        assert torch.equal(res[untouched], expect[untouched])
        assert torch.equal(bucket[0], g[:bucket[0].numel()].view(bucket[0].shape)) if n else True  # input kept
        prev = res.clone()


def test_compensate_allocates_nothing_after_the_first_step():
    ef = ErrorFeedback()
    bucket = [torch.randn(300, 7), torch.randn(5)]
    first = ef.compensate_("b", bucket, torch.float32)
    ptr = first.data_ptr()
    for _ in range(3):
        assert ef.compensate_("b", bucket, torch.float32).data_ptr() == ptr


def test_non_finite_never_stays_in_residual():
    ef = ErrorFeedback()
    g = torch.randn(1000)
    g[3], g[500] = float("nan"), float("inf")
    c = ef.compensate_("b", [g], torch.float32)
    sel = DragonnCompressor(0.01).compress(c, 0)
    assert {3, 500} <= set(sel.indices.tolist())
    ef.commit("b", sel.indices, sel.values, sel.values)
    assert bool(torch.isfinite(ef.residuals["b"]).all())


def test_wire_overflow_is_not_kept():
    """A finite compensated value that overflows the fp16 wire is sent as Inf; the residual there is 0."""
    ef = ErrorFeedback()
    g = torch.zeros(100, dtype=torch.float16)
    ef.residuals["b"] = torch.zeros(100)
    ef.residuals["b"][7] = 1e6
    c = ef.compensate_("b", [g], torch.float16)
    idx = torch.tensor([7])
    ef.commit("b", idx, c[idx], c[idx].to(torch.float16))
    assert ef.residuals["b"][7] == 0


def test_clear_non_finite():
    ef = ErrorFeedback()
    g = torch.randn(50)
    g[[4, 9]] = float("nan")
    ef.compensate_("b", [g], torch.float32)
    ef.clear_non_finite("b")
    res = ef.residuals["b"]
    assert bool(torch.isfinite(res).all()) and res[4] == 0 and res[9] == 0 and res[5] == g[5]


def test_disabled_keeps_nothing():
    ef = ErrorFeedback(enabled=False)
    g = torch.randn(100)
    c = ef.compensate_("b", [g], torch.float32, prescale=0.5)
    torch.testing.assert_close(c, g * 0.5, rtol=0, atol=0)
    ef.commit("b", torch.tensor([1]), c[1:2], c[1:2])
    assert ef.residuals == {}
    torch.testing.assert_close(ef.compensate_("b", [g], torch.float32), g, rtol=0, atol=0)


def test_state_dict_round_trip_and_shape_check():
    ef = ErrorFeedback()
    c = ef.compensate_("b", [torch.randn(10)], torch.float32)
    ef.commit("b", torch.tensor([0]), c[:1], c[:1])
    other = ErrorFeedback()
    other.load_state_dict(ef.state_dict())
    assert torch.equal(other.residuals["b"], ef.residuals["b"])
    with pytest.raises(ValueError, match="shape"):
        other.compensate_("b", [torch.randn(11)], torch.float32)


def test_rescale_one_key_leaves_the_others():
    """``rescale_(f, key=...)`` scales that key's residual only; an unknown key is a no-op; no key scales all."""
    from ds_dragonn.feedback import ErrorFeedback
    ef = ErrorFeedback()
    ef.residuals["a"] = torch.tensor([1.0, -2.0])
    ef.residuals["b"] = torch.tensor([4.0])
    ef.rescale_(0.5, key="a")
    assert ef.residuals["a"].tolist() == [0.5, -1.0] and ef.residuals["b"].tolist() == [4.0]
    ef.rescale_(0.5, key="missing")
    ef.rescale_(2.0)
    assert ef.residuals["a"].tolist() == [1.0, -2.0] and ef.residuals["b"].tolist() == [8.0]


@pytest.mark.parametrize("applied", [True, False])
def test_exact_steps_bring_back_a_residual_released_in_a_skipped_step(applied):
    """``transactional``: a buffer released during a step (stage 0's warm-up rounding, freed at the first compressed
    step) comes back bit for bit when DeepSpeed skips that step, and stays released when it applies it."""
    ef = ErrorFeedback(transactional=True)
    g = torch.randn(7, dtype=torch.float64)
    buf = ef.compensate_("dense", [g], torch.float64)
    kept = buf[[1, 4]].clone()
    ef.commit("dense", torch.tensor([1, 4]), kept, kept / 3)
    ef.end_step(True)
    before = ef.residuals["dense"].clone()
    ef.compensate_("grad", [torch.randn(5, dtype=torch.float64)], torch.float64)
    ef.release("dense")
    ef.end_step(applied)
    if applied:
        assert "dense" not in ef.residuals
    else:
        assert torch.equal(ef.residuals["dense"], before)
