"""ZeRO stage 3: the hook on the partitioned optimizer's gradient reduce-scatter.

Hook point (DeepSpeed 0.19.8 ``runtime/zero/stage3.py``): ``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads
(params, communication_data_type)``, called by ``__reduce_and_partition_ipg_grads`` on every IPG bucket (the
path of the default ``reduce_scatter: true``), is overridden on the optimizer *instance* (its mangled name
``_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads``). DeepSpeed's method reduce-scatters the bucket's full
gradients with ``reduce_scatter_coalesced`` (``runtime/comm/coalesced_collectives.py``): each gradient is cut
into ``P`` chunks of ``ceil(numel / P)``, the chunks are laid out rank by rank (chunk ``r`` of every gradient,
padded, then ``r + 1``…), divided by ``P`` and reduce-scattered, so rank ``r`` receives the mean of its chunks.

The override lays the bucket out the same way and sends it through the shared pipeline with the sparse
reduce-scatter exchange (:class:`~ds_dragonn.exchange.reduce_scatter.ReduceScatterExchange`): rank ``r`` owns
the flat range of its chunks, each selected pair goes to the rank owning its offset, and every rank keeps the
rest in its residual (error feedback, as at ZeRO 1/2). It returns the rank's chunks as DeepSpeed's method does
(``partition_grads`` then accumulates them into the fp32 partition). What stays DeepSpeed's own: the dense
warm-up, buckets below ``min_compress_numel``, the auto policy's dense choices, and the parameter
all-gathers of the forward and backward passes (hpZ keeps them inside the node).

The momentum mode (``compress: momentum``, as at ZeRO 1/2): each rank folds its full local gradients, in the
rank-major layout, into its local momentum per bucket key (``1/P`` the prescale, as DeepSpeed divides), and the
residual and the compressed exchange carry that momentum; what rank ``r`` gets back is its chunks of the
averaged momentum, which ``partition_grads`` puts into ``grad_partitions_flat_buffer`` and the step into the
fp32 sub-group flats' ``.grad``. Adam's variance freeze acts on those flats elementwise
(``engine/variance.py``, ``adam.optimizer_params``), so no map from buckets to sub-groups is needed. Variance
refresh steps reduce the raw gradient with DeepSpeed's own method, the step's momentum held in the residual.

Several nodes (``hierarchy``): the rank-major bucket goes through the node-aware pipeline
(:class:`~ds_dragonn.hierarchy.NodeAllreduce`: dense inside the node, the shard compressed across nodes with
``exchange``, gathered inside the node) and each rank keeps its chunks, as at ZeRO 1/2.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, List, NamedTuple, Optional

import torch

from ..constants import SEED
from ..exchange.reduce_scatter import RangeOwnership
from ..exchange.wire import dense_reduce_scatter_bytes
from ..pipeline import PhaseClock
from .base import ZeroPartitionHook
from .bucket import ZERO3, BucketKey, bucket_seed
from .checkpoint import install as install_checkpointing

#: DeepSpeed's private method, as Python mangles its name on the class
HOOKED = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


class RankMajor(NamedTuple):
    """``reduce_scatter_coalesced``'s layout of a bucket's gradients."""
    flat: torch.Tensor  # (world·per,) of the communication dtype, padding zeroed
    per: int            # elements per rank
    chunks: List[int]   # each gradient's chunk length per rank


def chunk_lengths(numels: List[int], world: int) -> List[int]:
    """Each gradient's chunk per rank, ``ceil(numel / world)`` (``reduce_scatter_coalesced``'s)."""
    return [math.ceil(n / world) for n in numels]


def rank_major(grads: List[torch.Tensor], world: int, dtype: torch.dtype,
               chunks: Optional[List[int]] = None) -> RankMajor:
    """``grads`` laid out rank by rank as ``reduce_scatter_coalesced`` does (``chunks``: their
    :func:`chunk_lengths`, where the caller has them already)."""
    if chunks is None:
        chunks = chunk_lengths([g.numel() for g in grads], world)
    per = sum(chunks)
    flat = torch.zeros(per * world, dtype=dtype, device=grads[0].device)
    for r in range(world):
        offset = r * per
        for g, c in zip(grads, chunks):
            part = g.reshape(-1)[r * c:(r + 1) * c]
            flat[offset:offset + part.numel()].copy_(part)
            offset += c
    return RankMajor(flat, per, chunks)


class Stage3Hook(ZeroPartitionHook):
    """ZeRO stage 3: compresses ``__avg_scatter_grads`` with a sparse reduce-scatter (module docstring)."""

    hook_name = "ZeRO stage 3 reduce-scatter"

    def __init__(self, engine: Any, cfg):
        super().__init__(engine, cfg)
        self.optimizer = engine.optimizer
        self._dense = getattr(self.optimizer, HOOKED)  # DeepSpeed's bound method
        self._names: Optional[dict] = None

    def install(self) -> "Stage3Hook":
        self.pipeline(self.optimizer.dp_process_group)  # a wrong launch fails at initialize
        setattr(self.optimizer, HOOKED, self.avg_scatter_grads)
        self.engine.dragonn = self
        install_checkpointing(self)
        self.reporter.start(self.hook_name, self.compressor.name, "reduce_scatter (ZeRO-3 partitions)" if self.layout
                            is None else f"node-aware {self.cfg.exchange.value} across nodes, each rank its chunks")
        return self

    def avg_scatter_grads(self, params: List[Any], communication_data_type: torch.dtype) -> List[torch.Tensor]:
        """Drop-in for DeepSpeed's ``__avg_scatter_grads``: this rank's chunk of each parameter's averaged
        gradient, in the optimizer's gradient accumulation dtype."""
        opt, engine = self.optimizer, self.engine
        import deepspeed.comm as dist
        group = opt._get_param_partition_group(params[0])
        if dist.get_world_size(group) != dist.get_world_size(opt.dp_process_group):
            if self.momentum is not None and not self.decision.schedule.dense(int(engine.global_steps)):
                raise RuntimeError("'dragonn.compress': 'momentum' cannot carry the momentum of gradients reduced "
                                   "outside the data-parallel group (MoE experts); use 'compress': 'gradient'")
            return self._dense(params, communication_data_type)  # MoE expert groups: dense
        step = int(engine.global_steps)
        self.steps.begin(step)
        self._follow_optimizer()  # momentum mode: the optimizer's β1
        ordinal = self._next_ordinal((step, int(engine.micro_steps)))
        pipeline = self.pipeline(opt.dp_process_group)
        world = pipeline.backend.world_size
        dt = communication_data_type
        numels = [p.grad.numel() for p in params]
        numel, chunks = sum(numels), chunk_lengths(numels, world)
        per = sum(chunks)
        key = BucketKey(ZERO3, ordinal, str(dt), world * per, self._layout(params))  # the residual's (padded) length
        dense_bytes = dense_reduce_scatter_bytes(numel, dt.itemsize, world)
        clock = PhaseClock(params[0].grad.device)
        if self._refreshes(step):  # momentum mode: the raw gradient, densely, refreshes Adam's variance
            self._hold_momentum(key, [self._flat(params, world, dt, chunks)], dt, 1.0 / world, pipeline)
            out = self._dense(params, dt)
            self._record_dense(key, numel, dt.itemsize, world, clock.lap(), True, dense_bytes)
            return out
        dense, fixed = self.decision.choose(key, numel, step, pipeline, dt, dense_bytes)
        flush = dense and (key in self.pending or self._carries_momentum(step))  # residual (and momentum) go out
        if dense and not flush:
            if self.momentum is not None:  # the warm-up's gradients start the local momentum
                self._track_momentum(pipeline, key, [self._flat(params, world, dt, chunks)], dt, 1.0 / world)
            out = self._dense(params, dt)
            self._record_dense(key, numel, dt.itemsize, world, clock.lap(), fixed, dense_bytes)
            return out
        flat = self._flat(params, world, dt, chunks)
        rank = pipeline.backend.rank
        if flush:  # compressed before, dense now: the residual goes out with this reduction
            out = pipeline.reduce_dense([flat], key, 1.0 / world, 1.0, dt)
            self._flushed(key)
            self._record_dense(key, numel, dt.itemsize, world, clock.lap(), fixed, dense_bytes)
        else:
            self._carries_momentum(step)
            self.reporter.announce(step)
            self.decision.set_density(self.compressor, step)
            ranges = [(r * per, per, r) for r in range(world)]
            out, stats = pipeline.reduce([flat], key, bucket_seed(SEED, step, ordinal), 1.0 / world, 1.0,
                                         dt, ownership=RangeOwnership(flat.numel(), ranges, world),
                                         age_step=self.age_clock(step))
            self._record_compressed(key, stats, pipeline, ordinal, step, flat.device)
        mine, parts, offset = out[rank * per:(rank + 1) * per], [], 0
        for p, c in zip(params, chunks):
            length = max(0, min(c, p.grad.numel() - rank * c))  # the last ranks' chunks may be short or empty
            parts.append(mine[offset:offset + length].to(opt.gradient_accumulation_dtype))
            offset += c
        return parts

    @staticmethod
    def _flat(params: List[Any], world: int, dt: torch.dtype, chunks: List[int]) -> torch.Tensor:
        """The bucket's local gradients in the rank-major layout, (world·per,) of ``dt``."""
        return rank_major([p.grad for p in params], world, dt, chunks).flat

    def _layout(self, params: List[Any]) -> str:
        """Digest of the bucket's parameters (names and shapes), part of the residual's key. Not ZeRO-3's
        ``ds_id``: a counter over the process, so a second engine of the same model gets other ids."""
        if self._names is None:
            self._names = {id(p): n for n, p in self.engine.module.named_parameters()}
        layout = repr(tuple((self._names.get(id(p), p.ds_id), tuple(p.ds_shape)) for p in params))
        return hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()


def check_zero3_hook_point(optimizer_cls: Optional[type] = None) -> None:
    """Fail loudly if a DeepSpeed upgrade renamed or re-signed what :class:`Stage3Hook` relies on in ZeRO
    stage 3: ``__avg_scatter_grads`` (replaced), its caller ``__reduce_and_partition_ipg_grads``, and
    ``partition_grads`` (which takes its result)."""
    from .probes import require_methods
    if optimizer_cls is None:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as optimizer_cls
    require_methods(optimizer_cls, {
        "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads": ("communication_data_type",),
        HOOKED: ("params_to_reduce", "communication_data_type"),
        "partition_grads": ("params_to_release", "grad_partitions"),
    }, "ds_dragonn's ZeRO-3 hook would be bypassed or wrong")


__all__ = ["HOOKED", "RankMajor", "Stage3Hook", "check_zero3_hook_point", "chunk_lengths", "rank_major"]
