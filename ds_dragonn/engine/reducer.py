"""Where a bucket's fate is decided: the one decision sequence every ZeRO stage runs.

A hook point (``stage0.py``, ``stage_1_and_2.py``, ``stage3.py``) hands each of DeepSpeed's gradient buckets to
:meth:`BucketReducer.reduce`, which runs the numbered steps below (begin, refresh, choose, dense, flush,
compressed). What differs between the stages is the adapter's (:class:`StageAdapter`). Every rank takes the same
branches: they depend only on the step, the bucket, the config and the auto policy's agreed state.
"""
from __future__ import annotations

from typing import Any, Hashable, NamedTuple, Optional, Protocol, Sequence

import torch

from ..constants import SEED
from ..exchange.quantize import PLAIN, ValueCodec
from ..pipeline import PhaseClock, timed_scope
from .bucket import bucket_seed


class Bucket:
    """One call's bucket, as its adapter describes it (:meth:`StageAdapter.describe`).

    Attributes:
        key: the residual's key (a :class:`~ds_dragonn.engine.bucket.BucketKey`).
        ordinal: the bucket's position in its reduction round (part of the selection seed).
        numel: gradient elements (without the rank-major padding of ZeRO 3).
        dtype: the communication dtype.
        pipeline: the pipeline of the bucket's data-parallel group.
        device: where the gradients live.
        dense_bytes: bytes per rank of the stage's dense collective (None: the pipeline's own count).
        quantized_bytes: bytes per rank of the dense step quantized (``advanced.dense_values``; None: not).
        call: the hook's arguments; ``local``: whatever the adapter keeps between its methods.
    """
    __slots__ = ("key", "ordinal", "numel", "dtype", "pipeline", "device", "dense_bytes", "quantized_bytes",
                 "call", "local")

    def __init__(self, key: Hashable, ordinal: int, numel: int, dtype: torch.dtype, pipeline: Any,
                 device: torch.device, call: Any, dense_bytes: Optional[int] = None,
                 quantized_bytes: Optional[int] = None, local: Any = None):
        self.key, self.ordinal, self.numel, self.dtype = key, ordinal, numel, dtype
        self.pipeline, self.device, self.call, self.local = pipeline, device, call, local
        self.dense_bytes, self.quantized_bytes = dense_bytes, quantized_bytes

    @property
    def world(self) -> int:
        return self.pipeline.backend.world_size

    @property
    def bytes_if_dense(self) -> Optional[int]:
        """What the dense choice would send per rank (the decision's comparison)."""
        return self.quantized_bytes if self.quantized_bytes is not None else self.dense_bytes


class Send(NamedTuple):
    """What goes through the pipeline (a flush or a compressed reduction), from :meth:`StageAdapter.prepare`.

    ``inputs``: the bucket's tensors; ``prescale``/``postscale``: the averaging applied before/after the sum;
    ``ownership``: which rank keeps which range (ZeRO partitions; None: every rank all of it); ``into``: decode
    straight into ``inputs``; ``codec``: the value codec of a flush (:data:`~ds_dragonn.exchange.quantize.PLAIN`: the
    communication dtype).
    """
    inputs: Sequence[torch.Tensor]
    prescale: float
    postscale: float
    ownership: Any = None
    into: bool = False
    codec: ValueCodec = PLAIN


class StageAdapter(Protocol):
    """What a ZeRO stage's hook supplies to :class:`BucketReducer`."""

    def describe(self, call: Any, step: int) -> Bucket:
        """The bucket of this call (counts its ordinal: once per call, after the step began)."""

    def momentum_input(self, bucket: Bucket) -> tuple:
        """``(tensors, prescale)``: the local gradients as the momentum mode folds them."""

    def dense(self, bucket: Bucket) -> Any:
        """DeepSpeed's own dense reduction of the raw gradients; returns what the hooked method returns."""

    def prepare(self, bucket: Bucket, step: int) -> Optional[Send]:
        """What goes through the pipeline; None where the adapter had DeepSpeed reduce it densely instead
        (parts the adapter does not model)."""

    def write(self, bucket: Bucket, out: Optional[torch.Tensor]) -> Any:
        """Put the pipeline's result where DeepSpeed would; returns what the hooked method returns."""


class BucketReducer:
    """The decision sequence of every bucket (module docstring), over a hook that is its stage's adapter and
    holds the state (:class:`~ds_dragonn.engine.base.HookBase`)."""

    __slots__ = ("hook",)

    def __init__(self, hook: Any):
        self.hook = hook

    def reduce(self, call: Any) -> Any:
        """Reduce one bucket (``call``: the hooked method's arguments, for the adapter); returns what the
        hooked DeepSpeed method returns."""
        hook = self.hook
        step = int(hook.engine.global_steps)
        # 1. Begin the step: settle the last one and follow the loss scale, the lr warm-up and β1.
        hook.steps.begin(step)
        hook._follow_optimizer()
        b = hook.describe(call, step)

        # 2. Refresh (momentum mode): the raw gradient, densely, refreshes Adam's variance; the step's
        #    momentum is held in the residual, unsent.
        if hook.mode.refreshes(step):
            clock = PhaseClock(b.device)  # fixed: the policy does not record it
            tensors, prescale = hook.momentum_input(b)
            hook.mode.hold(hook, b.key, tensors, b.dtype, prescale, b.pipeline)
            return self._dense_done(b, hook.dense(b), clock, fixed=True)

        # 3. Choose dense or compressed. Momentum mode after the warm-up: every bucket of this step, dense
        #    ones too, sends the momentum, so from now on Adam's variance may be frozen (the mode arms it).
        dense, fixed = hook.decision.choose(b.key, b.numel, step, b.pipeline, b.dtype, b.bytes_if_dense)
        sends_momentum = hook.mode.sends_momentum(step)
        flush = dense and (b.key in hook.pending or sends_momentum)
        # timed on the device (a CUDA sync) only where the auto policy records this reduction's time
        timed = hook.decision.times(b.key, step, dense=dense) and not (dense and fixed)
        clock = PhaseClock(b.device, timed=timed or None)

        # 4. Dense: DeepSpeed's own path (the momentum mode's warm-up folds the gradients into the momentum).
        if dense and not flush:
            hook.mode.track(b.pipeline, b.key, b.dtype, lambda: hook.momentum_input(b))
            return self._dense_done(b, hook.dense(b), clock, fixed)
        send = hook.prepare(b, step)
        if send is None:  # the adapter had DeepSpeed reduce what it does not model
            return self._dense_done(b, None, clock, fixed)

        # 5. Flush: compressed before, dense now: the residual (and momentum) go out with this reduction.
        if flush:
            out = b.pipeline.reduce_dense(send.inputs, b.key, send.prescale, send.postscale, b.dtype, send.codec,
                                          flush=b.key in hook.pending)
            hook._flushed(b.key)
            return self._dense_done(b, hook.write(b, out), clock, fixed)

        # 6. Compressed: the pipeline at this step's density.
        hook.reporter.announce(step)
        hook.decision.set_density(hook.compressor, step)
        with timed_scope(timed):
            out, stats = b.pipeline.reduce(send.inputs, b.key, bucket_seed(SEED, step, b.ordinal),
                                           send.prescale, send.postscale, b.dtype, into_inputs=send.into,
                                           ownership=send.ownership, age_step=hook.age_clock(step))
        result = hook.write(b, out)
        hook._record_compressed(b.key, stats, b.pipeline, b.ordinal, step, b.device)
        return result

    def _dense_done(self, b: Bucket, result: Any, clock: PhaseClock, fixed: bool) -> Any:
        self.hook._record_dense(b.key, b.numel, b.dtype.itemsize, b.world, clock.lap(), fixed, b.dense_bytes,
                                b.quantized_bytes)
        return result


__all__ = ["Bucket", "BucketReducer", "Send", "StageAdapter"]
