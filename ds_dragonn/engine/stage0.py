"""ZeRO stage 0: the hook on the engine's gradient allreduce.

Hook points (DeepSpeed 0.19.8 ``runtime/engine.py``): ``DeepSpeedEngine.allreduce_and_copy(small_bucket, dp_group,
dp_world_size)`` and ``allreduce_bucket(bucket, dp_group, dp_world_size)``, overridden on the engine *instance*.
Both must apply DeepSpeed's averaging (``gradient_predivide_factor``, ``prescale_gradients``) themselves, which
:func:`reduction_scales` reproduces. See docs/design.md, 'Where it hooks into DeepSpeed'.
"""
from __future__ import annotations

import hashlib
from typing import Any, NamedTuple, Optional

from ..exchange.dense_quantized import quantized_allreduce_bytes
from ..exchange.wire import dense_allreduce_bytes
from ..exchange.quantize import PLAIN, value_codec
from .base import HookBase
from .bucket import ALLREDUCE, DENSE, BucketKey
from .reducer import Bucket, Send


class Scales(NamedTuple):
    """Factors applied before (to the local buffer) and after (to the sum) the reduction."""
    prescale: float
    postscale: float


class Local(NamedTuple):
    """What a stage-0 bucket keeps between the adapter's methods: its averaging and how its dense steps go."""
    scales: Scales
    dense: Any  # _DeepSpeedDense, _QuantizedDense or _QuantizedWarmup


def reduction_scales(engine: Any, dp_world_size: float) -> Scales:
    """The scaling DeepSpeed's dense ``allreduce_bucket`` applies (0.19.8 ``runtime/engine.py``)."""
    if not engine.gradient_average:
        return Scales(1.0, 1.0)
    if engine.postscale_gradients():
        pre = engine.gradient_predivide_factor()
        return Scales(1.0 / pre if pre != 1.0 else 1.0, pre / dp_world_size if pre != dp_world_size else 1.0)
    return Scales(1.0 / dp_world_size, 1.0)


class Stage0Hook(HookBase):
    """ZeRO stage 0: compresses ``DeepSpeedEngine.allreduce_bucket`` / ``allreduce_and_copy``."""

    supports_hierarchy = True  # engine/pipelines.py: the node-aware pipeline
    hook_name = "ZeRO stage 0 allreduce"

    def __init__(self, engine: Any, cfg):
        super().__init__(engine, cfg)
        self._dense_allreduce_bucket = engine.allreduce_bucket  # DeepSpeed's bound method
        # how the dense steps go (advanced.dense_values): DeepSpeed's allreduce, or quantized where that costs less
        self._deepspeed = self._dense = _DeepSpeedDense(self)
        codec = value_codec(cfg.dense_values)
        if codec.quantized:
            self._dense = (_QuantizedWarmup if self.momentum is not None else _QuantizedDense)(self, codec)

    @property
    def dense_codec(self):
        """The quantized dense steps' codec (``advanced.dense_values``); None: DeepSpeed's allreduce only."""
        return None if self._dense is self._deepspeed else self._dense.codec

    def _dp_group(self):
        from deepspeed.utils import groups
        return groups._get_sequence_data_parallel_group()

    def _patch(self) -> None:
        self.engine.allreduce_bucket = self.allreduce_bucket
        self.engine.allreduce_and_copy = self.allreduce_and_copy

    def _scheme(self) -> str:
        return self.cfg.exchange.value

    # -- the hook -----------------------------------------------------------------------------------
    def allreduce_bucket(self, bucket, dp_group, dp_world_size=None):
        """Drop-in for ``DeepSpeedEngine.allreduce_bucket``: returns the reduced flat tensor."""
        return self.reducer.reduce((bucket, dp_group, dp_world_size, False))

    def allreduce_and_copy(self, small_bucket, dp_group, dp_world_size=None):
        """Drop-in for ``DeepSpeedEngine.allreduce_and_copy``: reduces and writes the gradients.

        Where the pipeline can, the compressed result is decoded straight into the gradients; otherwise the flat
        result is copied exactly as DeepSpeed does.
        """
        out = self.reducer.reduce((small_bucket, dp_group, dp_world_size, True))
        if out is not None:
            for buf, synced in zip(small_bucket, self.engine.unflatten(out, small_bucket)):
                buf.copy_(synced)

    # -- the stage adapter (engine/reducer.py) ------------------------------------------------------
    def describe(self, call, step: int) -> Bucket:
        """``call``: (the bucket's gradients, the data-parallel group, DeepSpeed's ``dp_world_size``, whether the
        result may be decoded into the gradients)."""
        bucket, dp_group, dp_world_size, into = call
        ordinal = self._next_ordinal(step)
        numel = sum(t.numel() for t in bucket)
        dt = self.engine.communication_data_type
        pipeline = self.pipeline(dp_group)
        world = pipeline.backend.world_size
        if dp_world_size is None:
            dp_world_size = world
        key = BucketKey(ALLREDUCE, ordinal, str(dt), numel, self._layout(bucket))
        # ties go to DeepSpeed's allreduce: quantized only where the codes' scales and alignment cost less
        way = min((self._deepspeed, self._dense), key=lambda w: w.sent_bytes(numel, world, dt.itemsize))
        return Bucket(key, ordinal, numel, dt, pipeline, bucket[0].device, (bucket, dp_group, dp_world_size, into),
                      quantized_bytes=way.quantized_bytes(numel, world, dt.itemsize),
                      local=Local(reduction_scales(self.engine, dp_world_size), way))

    def momentum_input(self, b: Bucket) -> tuple:
        return b.call[0], b.local.scales.prescale

    def prepare(self, b: Bucket, step: int) -> Send:
        """No flatten: the pipeline compensates the gradients straight into the persistent residual, and decodes
        into the gradients (where it can) or into its decode buffer, unflattened and copied into them."""
        bucket, _, _, into = b.call
        self._dense.prepare(b)
        return Send(bucket, *b.local.scales, into=into and b.pipeline.can_reduce_into(bucket, b.dtype),
                    codec=b.local.dense.codec)

    def write(self, b: Bucket, out):
        return out

    def dense(self, b: Bucket):
        """The raw gradients, densely, the bucket's way (:class:`_DeepSpeedDense`, :class:`_QuantizedDense`,
        :class:`_QuantizedWarmup`)."""
        return b.local.dense.reduce(b)

    def _layout(self, bucket) -> str:
        """Digest of the bucket's layout: its parameters' names (matched by gradient storage), or the
        gradients' shapes where a gradient is not a parameter's ``.grad``. Part of the residual's key: one
        tensor's residual is never applied to another of the same size."""
        names = {}
        for name, p in self.engine.module.named_parameters():
            g = p.grad
            if g is not None and g.numel():
                names[g.data_ptr()] = name
        layout = repr(tuple(names.get(t.data_ptr(), tuple(t.shape)) for t in bucket))
        return hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()


class _DeepSpeedDense:
    """Dense steps through DeepSpeed's own allreduce, in the communication dtype; a flush sends the residual in
    that dtype too."""
    codec = PLAIN

    def __init__(self, hook: Stage0Hook):
        self.hook = hook

    def sent_bytes(self, numel: int, world: int, itemsize: int) -> int:
        """Bytes per rank of a bucket's dense step this way."""
        return dense_allreduce_bytes(numel, itemsize, world)

    def quantized_bytes(self, numel: int, world: int, itemsize: int) -> Optional[int]:
        """:attr:`Bucket.quantized_bytes <ds_dragonn.engine.reducer.Bucket>`: None, the stage's dense collective."""
        return None

    def prepare(self, b: Bucket) -> None:
        """A bucket's compressed step (or flush) begins."""

    def reduce(self, b: Bucket):
        bucket, dp_group, dp_world_size, _ = b.call
        return self.hook._dense_allreduce_bucket(bucket, dp_group, dp_world_size)


class _QuantizedDense(_DeepSpeedDense):
    """``advanced.dense_values`` int8 / int4 (the gradient mode): the raw gradients' sum travels quantized, its
    rounding kept in the bucket's own residual (gradient too: it goes out with the next reduction); a flush
    sends the residual quantized too."""

    def __init__(self, hook: Stage0Hook, codec):
        super().__init__(hook)
        self.codec = codec

    def sent_bytes(self, numel: int, world: int, itemsize: int) -> int:
        return quantized_allreduce_bytes(numel, world, self.codec)

    quantized_bytes = sent_bytes

    def reduce(self, b: Bucket):
        out = b.pipeline.reduce_dense(b.call[0], b.key, *b.local.scales, b.dtype, self.codec, raw=True)
        self.hook._flushed(b.key)
        return out


class _QuantizedWarmup(_QuantizedDense):
    """``advanced.dense_values`` int8 / int4 in the momentum mode: the bucket's residual holds momentum, which
    these steps do not send. The dense warm-up keeps its rounding in a residual of its own (:data:`DENSE`),
    freed at the first step after it (:meth:`prepare`; at most half a quantization step per value dropped, once),
    and a variance refresh keeps none (its sum only refreshes the variance), so no buffer outlives the warm-up."""

    def prepare(self, b: Bucket) -> None:
        b.pipeline.release(b.key._replace(hook=DENSE))  # the warm-up is over

    def reduce(self, b: Bucket):
        rkey = b.key._replace(hook=DENSE)
        out = b.pipeline.reduce_dense(b.call[0], rkey, *b.local.scales, b.dtype, self.codec, raw=True)
        if not self.hook.decision.schedule.dense(int(self.hook.engine.global_steps)):
            b.pipeline.release(rkey)  # a refresh
        return out


def check_hook_point(engine_cls: Optional[type] = None) -> None:
    """Fail loudly if a DeepSpeed upgrade renamed or re-signed the ZeRO-0 methods the hook replaces
    (``allreduce_bucket``, ``allreduce_and_copy``) or the one that calls them (``allreduce_no_retain``)."""
    from .probes import require_methods
    if engine_cls is None:
        from deepspeed.runtime.engine import DeepSpeedEngine as engine_cls
    require_methods(engine_cls, {"allreduce_no_retain": ("bucket", "dp_group"),
                                 "allreduce_and_copy": ("small_bucket", "dp_group", "dp_world_size"),
                                 "allreduce_bucket": ("bucket", "dp_group", "dp_world_size")},
                    "ds_dragonn's hook would be bypassed")
