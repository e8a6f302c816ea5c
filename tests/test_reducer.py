"""The one decision sequence (engine/reducer.py), over a recording stage adapter and a fake pipeline.

Each case checks which of the adapter's parts and which pipeline call a bucket reaches, and the state the
sequence leaves (owed flushes, the variance freeze, the records), without a process group.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_dragonn.config import DragonnConfig
from ds_dragonn.engine.base import HookBase
from ds_dragonn.engine.reducer import Bucket, Send
from ds_dragonn.exchange.quantize import PLAIN
from ds_dragonn.pipeline import ReduceStats
from tests.fakes import fake_engine


class FakePipeline:
    """World 1; records the reductions asked for and returns the inputs' sum, scaled."""

    def __init__(self):
        self.backend = SimpleNamespace(world_size=1, rank=0)
        self.exchange = SimpleNamespace(max_bytes=lambda numel, pairs, dtype, world: 0,
                                        dense_bytes=lambda numel, itemsize, world: numel * itemsize)
        self.calls = []

    def reduce_dense(self, inputs, key, prescale, postscale, dtype, codec=None, flush=False):
        self.calls.append(("reduce_dense", key, prescale, postscale, codec))
        self.flushes = getattr(self, "flushes", []) + [(key, flush)]
        return torch.cat([t.reshape(-1) for t in inputs]) * prescale * postscale

    def reduce(self, inputs, key, seed, prescale, postscale, dtype, into_inputs=False, ownership=None,
               age_step=None):
        self.calls.append(("reduce", key, prescale, postscale, into_inputs, ownership, age_step))
        out = torch.cat([t.reshape(-1) for t in inputs]) * prescale * postscale
        numel = out.numel()
        return out, ReduceStats(numel=numel, k=numel, kept=numel, capacity=numel, bytes_sent=0, dense_bytes=0,
                                compress_ms=0.0)


class RecordingHook(HookBase):
    """A stage adapter that records which of its parts the reducer calls."""

    def __init__(self, engine, cfg, unmodelled=False):
        super().__init__(engine, cfg)
        self.fake = FakePipeline()
        self.events = []
        self.unmodelled = unmodelled

    def pipeline(self, group):
        return self.fake

    def describe(self, call, step):
        grad, name = call
        self.events.append("describe")
        return Bucket(name, self._next_ordinal(step), grad.numel(), grad.dtype, self.fake, grad.device, call,
                      dense_bytes=grad.numel() * grad.element_size())

    def momentum_input(self, b):
        self.events.append("momentum_input")
        return [b.call[0]], 0.5

    def dense(self, b):
        self.events.append("dense")
        return "deepspeed"

    def prepare(self, b, step):
        self.events.append("prepare")
        return None if self.unmodelled else Send([b.call[0]], 0.5, 2.0, ownership="owners")

    def write(self, b, out):
        self.events.append("write")
        return out


def _hook(unmodelled=False, **block):
    p = torch.nn.Parameter(torch.zeros(8))
    engine = fake_engine(optimizer=torch.optim.AdamW([p], lr=0.1))
    return RecordingHook(engine, DragonnConfig(enabled=True, policy="always", min_compress_numel=4, **block),
                         unmodelled)


def test_warm_up_is_deepspeed_dense_then_compressed_then_a_flush_where_a_residual_is_owed():
    hook = _hook(warmup_steps=1)
    g = torch.arange(8.0)
    assert hook.reducer.reduce((g, "a")) == "deepspeed"  # step 0: the warm-up
    assert hook.events == ["describe", "dense"] and hook.fake.calls == [] and not hook.pending
    hook.engine.global_steps = 1
    hook.events.clear()
    out = hook.reducer.reduce((g, "a"))
    assert hook.events == ["describe", "prepare", "write"]
    assert torch.equal(out, g) and hook.fake.calls[0][:6] == ("reduce", "a", 0.5, 2.0, False, "owners")
    assert "a" in hook.pending  # error feedback: the residual may hold unsent gradient
    # a bucket below min_compress_numel whose residual is owed: a flush, not DeepSpeed's path
    hook.pending.add("small")
    hook.events.clear()
    out = hook.reducer.reduce((g[:3], "small"))
    assert hook.events == ["describe", "prepare", "write"] and hook.fake.calls[-1] == ("reduce_dense", "small", 0.5,
                                                                                       2.0, PLAIN)
    assert "small" not in hook.pending and torch.equal(out, g[:3]) and hook.fake.flushes[-1] == ("small", True)
    # one owes nothing: DeepSpeed's own path
    hook.events.clear()
    assert hook.reducer.reduce((g[:3], "tiny")) == "deepspeed" and hook.events == ["describe", "dense"]
    assert hook.telemetry.dense_reductions == 3 and hook.telemetry.compressed_reductions == 1


def test_a_bucket_the_adapter_does_not_model_is_recorded_dense():
    hook = _hook(unmodelled=True, warmup_steps=0)
    assert hook.reducer.reduce((torch.ones(8), "a")) is None
    assert hook.events == ["describe", "prepare"] and hook.fake.calls == [] and not hook.pending
    assert hook.telemetry.dense_reductions == 1


@pytest.mark.parametrize("pending", [False, True])
def test_momentum_mode_sends_the_momentum_from_every_bucket_and_arms_the_variance_freeze(pending):
    """After the warm-up every bucket carries the momentum, dense ones too (a flush, never DeepSpeed's raw
    gradients), and the variance freeze is armed whether or not a residual was owed already."""
    hook = _hook(warmup_steps=1, compress="momentum")
    g = torch.arange(8.0)
    hook.reducer.reduce((g[:3], "small"))  # the warm-up: DeepSpeed's path, the gradients start the momentum
    assert hook.events == ["describe", "momentum_input", "dense"] and "small" in hook.momentum.momenta
    assert not hook.variance_freeze.armed
    hook.engine.global_steps = 1
    if pending:
        hook.pending.add("small")
    hook.events.clear()
    hook.reducer.reduce((g[:3], "small"))
    assert hook.events == ["describe", "prepare", "write"] and hook.fake.calls[-1][0] == "reduce_dense"
    assert hook.fake.flushes[-1] == ("small", pending)  # only an owed residual is a flush (logged for a skip)
    assert hook.variance_freeze.armed


def test_a_variance_refresh_holds_the_momentum_and_reduces_the_raw_gradient():
    hook = _hook(warmup_steps=1, compress="momentum", advanced={"variance_refresh_steps": 2})
    hook.engine.global_steps = 2
    assert hook.mode.refreshes(2)
    assert hook.reducer.reduce((torch.ones(8), "a")) == "deepspeed"
    assert hook.events == ["describe", "momentum_input", "dense"] and hook.fake.calls == []
    assert "a" in hook.pending and hook.variance_freeze.armed


def test_only_the_auto_policys_probes_are_timed_on_the_device(monkeypatch):
    """An untimed clock on CUDA reads 0.0 (no sync): the auto policy's probes must be timed, or it would
    compare zeros; every other reduction stays untimed (no device sync)."""
    from ds_dragonn import constants
    from ds_dragonn.engine import reducer as reducer_module
    from ds_dragonn.pipeline import PhaseClock, timing_requested
    from ds_dragonn.policy import Phase

    clocks = []

    class Recording(PhaseClock):
        def __init__(self, device, timed=None):
            super().__init__(device, timed)
            clocks.append(self.timed)

    monkeypatch.setattr(reducer_module, "PhaseClock", Recording)
    p = torch.nn.Parameter(torch.zeros(8))
    hook = RecordingHook(fake_engine(optimizer=torch.optim.SGD([p], lr=0.1)),
                         DragonnConfig(enabled=True, policy="auto", min_compress_numel=4, warmup_steps=0,
                                       density_warmup_steps=0), False)
    seen = []
    inner = hook.fake.reduce
    hook.fake.reduce = lambda *a, **k: (seen.append(timing_requested()), inner(*a, **k))[1]
    g = torch.arange(8.0)
    probes = constants.AUTO_PROBE_STEPS
    for step in range(probes):  # the dense probes
        hook.engine.global_steps = step
        assert hook.reducer.reduce((g, "a")) == "deepspeed"
    assert clocks == [True] * probes and seen == []
    for step in range(probes, 2 * probes - 1):  # compressed probes (not the last: its decision is a collective)
        hook.engine.global_steps = step
        hook.reducer.reduce((g, "a"))
    assert seen == [True] * (probes - 1) and not timing_requested()  # the scope ends with the reduction
    hook.decision.policy.buckets["a"].phase = Phase.decided  # decided: compressed, untimed
    clocks.clear()
    hook.engine.global_steps = 2 * probes
    hook.reducer.reduce((g, "a"))
    assert seen[-1] is False and clocks == [False]
