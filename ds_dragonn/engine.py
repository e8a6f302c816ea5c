"""The DeepSpeed hook: DeepSpeed's flattened gradient buckets in, averaged gradients out.

Hook points: ``DeepSpeedEngine.allreduce_and_copy(small_bucket, dp_group, dp_world_size)`` and
``allreduce_bucket(bucket, dp_group, dp_world_size)`` are overridden on the engine *instance*
(DeepSpeed 0.19.8 ``runtime/engine.py``: ``allreduce_gradients`` → ``buffered_allreduce_fallback`` →
``allreduce_no_retain`` → ``allreduce_and_copy`` → ``allreduce_bucket``, then a copy of the flat result
into the gradients). Both receive same-dtype buckets of the ZeRO stage-0 path and must apply DeepSpeed's
averaging (``gradient_predivide_factor``, ``prescale_gradients``) themselves, which
:func:`reduction_scales` reproduces. ``allreduce_and_copy`` lets the compressed path decode straight
into the gradients (no flat result, no copy back); ``allreduce_bucket`` serves every other caller.
Warm-up steps and small buckets call DeepSpeed's own ``allreduce_bucket``. Every rank takes the same
branch: the decision depends only on the step, the bucket size, the config and the auto policy's
agreed state.
"""
from __future__ import annotations

import hashlib
import inspect
from typing import Any, Dict, Hashable, NamedTuple, Optional

from deepspeed.utils.logging import print_dist

from .comm import build_backend
from .exchange import build_exchange
from .comm.base import CommBackend
from .compress import build_compressor
from .config import DragonnConfig, Policy
from .feedback import ErrorFeedback
from .pipeline import CompressedAllreduce, PhaseClock, ReduceStats
from .policy import AutoPolicy
from .telemetry import Telemetry, log_reduction, monitor_events


class Scales(NamedTuple):
    """Factors applied before (to the local buffer) and after (to the sum) the reduction."""
    prescale: float
    postscale: float


def reduction_scales(engine: Any, dp_world_size: float) -> Scales:
    """The scaling DeepSpeed's dense ``allreduce_bucket`` applies (0.19.8 ``runtime/engine.py``)."""
    if not engine.gradient_average:
        return Scales(1.0, 1.0)
    if engine.postscale_gradients():
        pre = engine.gradient_predivide_factor()
        return Scales(1.0 / pre if pre != 1.0 else 1.0, pre / dp_world_size if pre != dp_world_size else 1.0)
    return Scales(1.0 / dp_world_size, 1.0)


def bucket_seed(seed: int, step: int, ordinal: int) -> int:
    """Seed for (step, bucket): the same on every rank, different every step (paper: per-step hash seed)."""
    return (seed * 1_000_003 + step * 7919 + ordinal) & 0xFFFF_FFFF_FFFF


class DragonnHook:
    """Per-engine DRAGONN state, installed as ``engine.dragonn``.

    Fields: the config (``cfg``); the compressor, error-feedback store and transport per data-parallel
    group; the bucket ordinal within the current step; :class:`Telemetry` totals.
    """

    def __init__(self, engine: Any, cfg: DragonnConfig):
        self.engine = engine
        self.cfg = cfg
        self.compressor = build_compressor(cfg)
        self.error_feedback = ErrorFeedback(cfg.error_feedback)
        self.telemetry = Telemetry()
        self._pipelines: Dict[int, CompressedAllreduce] = {}
        self._dense_allreduce_bucket = engine.allreduce_bucket  # DeepSpeed's bound method
        self._step = -1
        self._ordinal = 0
        self._warned_small = False
        self._announced = False  # the switch to compression was logged
        self._pending: set = set()  # buckets whose residual may hold unsent gradient
        self.policy = AutoPolicy(cfg.auto_probe_steps, cfg.auto_recheck_interval,
                                 always=cfg.policy == Policy.always)

    # -- installation -------------------------------------------------------------------------------
    def install(self) -> "DragonnHook":
        # build the transport for the engine's data-parallel group now, so a wrong launch (e.g. an MPI
        # world that is not the data-parallel group) fails at initialize, not after the warm-up steps
        from deepspeed.utils import groups
        self._pipeline(groups._get_sequence_data_parallel_group())
        self.engine.allreduce_bucket = self.allreduce_bucket
        self.engine.allreduce_and_copy = self.allreduce_and_copy
        self.engine.dragonn = self
        print_dist(f"DRAGONN enabled: compressor={self.compressor.name} density={self.cfg.density} "
                   f"kernel={getattr(self.cfg.kernel, 'value', self.cfg.kernel)} "
                   f"sample_ratio={self.cfg.sample_ratio} table_factor={self.cfg.table_factor} "
                   f"min_compress_numel={self.cfg.min_compress_numel} warmup_steps={self.cfg.warmup_steps} "
                   f"error_feedback={self.cfg.error_feedback} comm_backend={self.cfg.comm_backend.value} "
                   f"exchange={self.cfg.exchange.value} policy={self.cfg.policy.value}"
                   f"{f' (probe {self.cfg.auto_probe_steps} steps, re-check every {self.cfg.auto_recheck_interval})' if self.cfg.policy == Policy.auto else ''}",
                   ranks=[0])
        return self

    def _pipeline(self, dp_group: Any) -> CompressedAllreduce:
        key = id(dp_group)
        if key not in self._pipelines:
            backend: CommBackend = build_backend(self.cfg, dp_group)
            self._pipelines[key] = CompressedAllreduce(self.compressor, backend, self.error_feedback,
                                                       build_exchange(self.cfg, backend, self.compressor))
        return self._pipelines[key]

    # -- the hook -----------------------------------------------------------------------------------
    def allreduce_bucket(self, bucket, dp_group, dp_world_size=None):
        """Drop-in for ``DeepSpeedEngine.allreduce_bucket``: returns the reduced flat tensor."""
        return self._reduce(bucket, dp_group, dp_world_size, into_bucket=False)

    def allreduce_and_copy(self, small_bucket, dp_group, dp_world_size=None):
        """Drop-in for ``DeepSpeedEngine.allreduce_and_copy``: reduces and writes the gradients.

        Where the pipeline can, the compressed result is decoded straight into the gradients (zeroed in the
        compensation pass), which saves DeepSpeed's copy of a flat result back into them; otherwise the
        flat result is copied exactly as DeepSpeed does.
        """
        out = self._reduce(small_bucket, dp_group, dp_world_size, into_bucket=True)
        if out is not None:
            for buf, synced in zip(small_bucket, self.engine.unflatten(out, small_bucket)):
                buf.copy_(synced)

    def _reduce(self, bucket, dp_group, dp_world_size, into_bucket: bool):
        """One bucket: dense (warm-up, small, auto) or compressed; None when decoded into ``bucket``."""
        engine = self.engine
        step = int(engine.global_steps)
        if step != self._step:
            self._step, self._ordinal = step, 0
        ordinal = self._ordinal
        self._ordinal += 1

        numel = sum(t.numel() for t in bucket)
        comm_dtype = engine.communication_data_type
        pipeline = self._pipeline(dp_group)
        world = pipeline.backend.world_size
        if dp_world_size is None:
            dp_world_size = world
        key: Hashable = (ordinal, str(comm_dtype), numel, self._layout(bucket))
        small = numel < max(self.cfg.min_compress_numel, 1)
        if small and not self._warned_small:
            self._warned_small = True
            print_dist(f"DRAGONN: a gradient bucket of {numel} elements is below min_compress_numel="
                       f"{self.cfg.min_compress_numel}: it uses DeepSpeed's dense allreduce (lower "
                       f"'dragonn.min_compress_numel' to compress it)", ranks=[0])
        warm = step < self.cfg.warmup_steps
        if small or warm or not self.policy.compress(key):
            clock = PhaseClock(bucket[0].device)
            if key in self._pending and not small:  # compressed before: flush its residual now
                out = pipeline.reduce_dense(bucket, key, *reduction_scales(engine, dp_world_size), comm_dtype)
                self._pending.discard(key)
            else:
                out = self._dense_allreduce_bucket(bucket, dp_group, dp_world_size)
            ms = clock.lap()
            if not small:
                self.policy.record_dense(key, ms)
            self.telemetry.record_dense(numel, comm_dtype.itemsize, world, ms)
            self._monitor(None, ms)
            return out

        if not self._announced:
            self._announced = True
            if self.cfg.policy == Policy.auto:
                print_dist(f"DRAGONN auto: timing the compressed path from step {step + 1} (after "
                           f"{self.cfg.warmup_steps} warm-up steps and the dense probes); the decision follows "
                           f"after {self.cfg.auto_probe_steps} compressed steps", ranks=[0])
            else:
                print_dist(f"DRAGONN: compressing from step {step + 1} (after {self.cfg.warmup_steps} dense "
                           f"warm-up steps)", ranks=[0])
        scales = reduction_scales(engine, dp_world_size)
        # no flatten: the pipeline compensates the bucket's gradients straight into the persistent
        # residual; it decodes into the gradients themselves (from allreduce_and_copy, where it can), or
        # returns its persistent decode buffer, which is unflattened and copied into them
        into = into_bucket and pipeline.can_reduce_into(bucket, comm_dtype)
        out, stats = pipeline.reduce(bucket, key, bucket_seed(self.cfg.seed, step, ordinal), scales.prescale,
                                     scales.postscale, comm_dtype, into_inputs=into)
        if self.error_feedback.enabled:
            self._pending.add(key)
        self.telemetry.record_compressed(stats)
        total_ms = stats.compress_ms + stats.exchange_ms + stats.decode_ms
        if self.policy.record_compressed(key, total_ms):
            compress, dense_ms, comp_ms = self.policy.decide(key, pipeline.backend, bucket[0].device)
            print_dist(f"DRAGONN auto: bucket {ordinal} ({numel} elements) dense {dense_ms:.2f} ms, compressed "
                       f"{comp_ms:.2f} ms -> {'compress' if compress else 'dense allreduce'}"
                       f"{f' (re-check in {self.cfg.auto_recheck_interval} steps)' if self.cfg.auto_recheck_interval else ''}",
                       ranks=[0])
        if self.cfg.log_interval and self.telemetry.compressed_reductions % self.cfg.log_interval == 0:
            # 1-based like DeepSpeed's own step logs (global_steps is incremented after engine.step())
            log_reduction(step + 1, stats)
        self._monitor(stats)
        return out

    def _layout(self, bucket) -> str:
        """Digest of the bucket's layout: its parameters' names (matched by gradient storage), or the
        gradients' shapes where a gradient is not a parameter's ``.grad``. Part of the residual's key, so
        that when the set of trainable parameters changes, one tensor's residual is never applied to
        another of the same size (each layout keeps its own residual, resumed when it returns)."""
        names = {}
        for name, p in self.engine.module.named_parameters():
            g = p.grad
            if g is not None and g.numel():
                names[g.data_ptr()] = name
        layout = repr(tuple(names.get(t.data_ptr(), tuple(t.shape)) for t in bucket))
        return hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()

    def _monitor(self, stats: Optional[ReduceStats], dense_ms: Optional[float] = None) -> None:
        monitor = getattr(self.engine, "monitor", None)
        if monitor is None or not getattr(monitor, "enabled", False):
            return
        # DeepSpeed's x-axis: the global samples its Train/Samples/* events of this step will carry
        samples = int(getattr(self.engine, "global_samples", 0)) + int(self.engine.train_batch_size())
        monitor.write_events(monitor_events(self.telemetry, samples, stats, dense_ms))

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Residuals (the partitioned exchange's server residuals too) and counters, of this rank."""
        return {"error_feedback": self.error_feedback.state_dict(), "telemetry": self.telemetry.summary(),
                "exchange": [p.exchange.state_dict() for p in self._pipelines.values()]}

    def load_state_dict(self, state: dict) -> None:
        self.error_feedback.load_state_dict(state["error_feedback"])
        for pipe, ex_state in zip(self._pipelines.values(), state.get("exchange", [])):
            pipe.exchange.load_state_dict(ex_state)


def check_hook_point(engine_cls: Optional[type] = None) -> None:
    """Fail loudly if a DeepSpeed upgrade no longer routes ZeRO-0 buckets through the hooked methods.

    Checks that ``allreduce_and_copy`` still only reduces through ``allreduce_bucket`` and copies the result
    into the gradients (what our override of it reproduces), and that ``allreduce_no_retain`` calls it.
    """
    if engine_cls is None:
        from deepspeed.runtime.engine import DeepSpeedEngine as engine_cls
    src = inspect.getsource(engine_cls.allreduce_and_copy)
    if "self.allreduce_bucket(" not in src or "buf.copy_(synced)" not in src:
        raise RuntimeError("this DeepSpeed version no longer reduces through DeepSpeedEngine.allreduce_bucket "
                           "and copies the result in allreduce_and_copy; ds_dragonn's hook would be bypassed "
                           "(tested with 0.19.8)")
    if "self.allreduce_and_copy(" not in inspect.getsource(engine_cls.allreduce_no_retain):
        raise RuntimeError("this DeepSpeed version no longer calls DeepSpeedEngine.allreduce_and_copy from "
                           "allreduce_no_retain; ds_dragonn's hook would be bypassed (tested with 0.19.8)")
