"""The auto compression policy (state machine, agreement) and the residual flush when a bucket goes dense."""
from __future__ import annotations

import pytest
import torch

from ds_dragonn.comm.base import CommBackend
from ds_dragonn.compress import DragonnCompressor
from ds_dragonn.feedback import ErrorFeedback
from ds_dragonn.pipeline import CompressedAllreduce
from ds_dragonn.policy import AutoPolicy, Phase


class LocalBackend(CommBackend):
    """World size 1, or a simulated world whose other ranks report ``peer`` values in all_reduce_sum_."""
    name = "local"

    def __init__(self, peers=()):
        self.peers = [torch.as_tensor(p, dtype=torch.float64) for p in peers]

    @property
    def rank(self):
        return 0

    @property
    def world_size(self):
        return 1 + len(self.peers)

    def all_gather_ints(self, values, device):
        return [list(values)] * self.world_size

    def all_gather_bytes(self, payload):
        return payload.unsqueeze(0).expand(self.world_size, -1).clone()

    def all_to_all_bytes(self, payload, send_sizes, recv_sizes):
        assert self.world_size == 1, "simulated peers take part in allreduces only"
        return payload.clone()

    def all_reduce_sum_(self, tensor):
        for p in self.peers:
            tensor.add_(p.to(tensor.dtype))


def test_policy_probes_decides_and_rechecks():
    pol = AutoPolicy(probe_steps=2, recheck_interval=3)
    key = "b"
    assert not pol.compress(key)
    pol.record_dense(key, 10.0)
    pol.record_dense(key, 12.0)
    assert pol.compress(key)  # now probing the compressed path
    assert not pol.record_compressed(key, 5.0)
    assert pol.record_compressed(key, 7.0)  # decision due
    compress, dense_ms, comp_ms = pol.decide(key, LocalBackend(), torch.device("cpu"))
    assert compress and dense_ms == 11.0 and comp_ms == 6.0
    for _ in range(3):
        assert pol.compress(key)
        pol.record_compressed(key, 6.0)
    assert pol.buckets[key].phase is Phase.probe_dense and not pol.compress(key)  # re-check


def test_decision_uses_the_mean_over_ranks():
    """This rank alone would compress (5 < 10), but the other rank measured 30 vs 10: all ranks go dense."""
    pol = AutoPolicy(probe_steps=1, recheck_interval=0)
    pol.record_dense("b", 10.0)
    assert pol.record_compressed("b", 5.0)
    compress, dense_ms, comp_ms = pol.decide("b", LocalBackend(peers=[[10.0, 30.0]]), torch.device("cpu"))
    assert not compress and dense_ms == 10.0 and comp_ms == 17.5
    for _ in range(5):
        assert not pol.compress("b")
        pol.record_dense("b", 1.0)
    assert pol.buckets["b"].phase is Phase.decided  # recheck_interval 0: never again


def test_always_never_probes():
    pol = AutoPolicy(always=True)
    assert pol.compress("b") and not pol.record_compressed("b", 1.0)
    with pytest.raises(ValueError, match="probe_steps"):
        AutoPolicy(probe_steps=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flush_sends_the_residual_nothing_lost(dtype):
    """Compressed steps, then a dense step: everything applied + residual == every gradient (float64)."""
    pipe = CompressedAllreduce(DragonnCompressor(0.01, min_sample=64), LocalBackend(), ErrorFeedback())
    gen = torch.Generator().manual_seed(3)
    applied = torch.zeros(5000, dtype=torch.float64)
    raw = torch.zeros(5000, dtype=torch.float64)
    for step in range(4):
        g = [torch.randn(4000, generator=gen).to(dtype), torch.randn(10, 100, generator=gen).to(dtype)]
        raw += torch.cat([t.flatten() for t in g]).double()
        if step < 3:
            out, _ = pipe.reduce(g, "b", seed=step, dtype=dtype)
        else:
            out = pipe.reduce_dense(g, "b", dtype=dtype)
        applied += out.double()
    res = pipe.error_feedback.residuals["b"].double()
    # exact up to the float32 rounding of each compensation (res + g), a few ulp of |g| ~ 4
    torch.testing.assert_close(applied + res, raw, rtol=0, atol=4 * 4 * 2.0**-23 * 4)
    if dtype == torch.float32:
        assert bool((res == 0).all())  # a flush leaves nothing behind
    else:
        assert float(res.abs().max()) < 0.02  # only the bf16 rounding of the flush


def test_residual_beyond_fp16_range_is_clamped_not_lost():
    """fp32 gradients over an fp16 wire: the residual outgrows 65504; nothing Inf is sent, nothing is lost."""
    pipe = CompressedAllreduce(DragonnCompressor(0.01), LocalBackend(), ErrorFeedback())
    raw = torch.zeros(1000, dtype=torch.float64)
    applied = torch.zeros(1000, dtype=torch.float64)
    for step in range(4):
        g = torch.full((1000,), 40000.0)
        raw += g.double()
        out, _ = pipe.reduce([g], "b", seed=step, dtype=torch.float16)
        assert bool(torch.isfinite(out).all()), f"step {step}"
        applied += out.double()
    res = pipe.error_feedback.residuals["b"].double()
    torch.testing.assert_close(applied + res, raw, rtol=1e-6, atol=0)


def test_flush_over_an_fp16_wire_clamps_like_the_compressed_path():
    """The dense flush sends the residual through the same wire rule: no Inf, the excess stays."""
    pipe = CompressedAllreduce(DragonnCompressor(0.01), LocalBackend(), ErrorFeedback())
    g = torch.full((1000,), 40000.0)
    out, _ = pipe.reduce([g], "b", seed=0, dtype=torch.float16)
    applied = out.double().clone()
    out = pipe.reduce_dense([g], "b", dtype=torch.float16)
    assert bool(torch.isfinite(out).all())
    applied += out.double()
    res = pipe.error_feedback.residuals["b"].double()
    torch.testing.assert_close(applied + res, g.double() * 2, rtol=1e-6, atol=0)
