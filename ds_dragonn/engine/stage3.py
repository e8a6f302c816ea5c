"""ZeRO stage 3: the hook on the partitioned optimizer's gradient reduce-scatter.

Hook point (DeepSpeed 0.19.8 ``runtime/zero/stage3.py``): ``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads
(params, communication_data_type)``, called by ``__reduce_and_partition_ipg_grads`` on every IPG bucket, is
overridden on the optimizer *instance* (mangled name ``_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads``).
The override lays the bucket out as ``reduce_scatter_coalesced`` (``runtime/comm/coalesced_collectives.py``)
does, rank by rank, and sends it through the pipeline with
:class:`~ds_dragonn.exchange.reduce_scatter.ReduceScatterExchange` (node-aware: ``hierarchy.NodeAllreduce``);
it returns the rank's chunks as DeepSpeed's method does. The momentum mode, its variance freeze on the fp32
sub-group flats, and what stays dense: see docs/design.md, 'Where it hooks into DeepSpeed'.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, List, NamedTuple, Optional

import torch

from ..exchange.reduce_scatter import RangeOwnership
from ..exchange.wire import dense_reduce_scatter_bytes
from .base import ZeroPartitionHook
from .bucket import ZERO3, BucketKey
from .reducer import Bucket, Send

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


class _Prepared(NamedTuple):
    """A bucket's state between :meth:`Stage3Hook.prepare` and ``write``: its chunk lengths and rank-major copy."""
    chunks: List[int]
    flat: torch.Tensor


class Stage3Hook(ZeroPartitionHook):
    """ZeRO stage 3: compresses ``__avg_scatter_grads`` with a sparse reduce-scatter (module docstring)."""

    flat_scheme = "reduce_scatter (ZeRO-3 partitions)"
    node_scheme = "each rank its chunks"
    hook_name = "ZeRO stage 3 reduce-scatter"

    def __init__(self, engine: Any, cfg):
        super().__init__(engine, cfg)
        self._dense = getattr(self.optimizer, HOOKED)  # DeepSpeed's bound method
        self._names: Optional[dict] = None

    def _patch(self) -> None:
        setattr(self.optimizer, HOOKED, self.avg_scatter_grads)


    def avg_scatter_grads(self, params: List[Any], communication_data_type: torch.dtype) -> List[torch.Tensor]:
        """Drop-in for DeepSpeed's ``__avg_scatter_grads``: this rank's chunk of each parameter's averaged
        gradient, in the optimizer's gradient accumulation dtype."""
        import deepspeed.comm as dist
        opt = self.optimizer
        group = opt._get_param_partition_group(params[0])
        if dist.get_world_size(group) != dist.get_world_size(opt.dp_process_group):
            self.mode.refuse_unmodelled(int(self.engine.global_steps),
                                        "gradients reduced outside the data-parallel group (MoE experts)")
            return self._dense(params, communication_data_type)  # MoE expert groups: dense
        return self.reducer.reduce((params, communication_data_type))

    # -- the stage adapter (engine/reducer.py) ------------------------------------------------------
    def describe(self, call, step: int) -> Bucket:
        """``call``: (the bucket's parameters, the communication dtype). The key counts the rank-major
        layout's padded length (the residual's); the decision and the records, the gradients' elements."""
        params, dt = call
        ordinal = self._next_ordinal((step, int(self.engine.micro_steps)))
        pipeline = self.pipeline(self.optimizer.dp_process_group)
        world = pipeline.backend.world_size
        numels = [p.grad.numel() for p in params]
        numel, chunks = sum(numels), chunk_lengths(numels, world)
        key = BucketKey(ZERO3, ordinal, str(dt), world * sum(chunks), self._layout(params))
        return Bucket(key, ordinal, numel, dt, pipeline, params[0].grad.device, call,
                      dense_bytes=dense_reduce_scatter_bytes(numel, dt.itemsize, world), local=chunks)

    def momentum_input(self, b: Bucket) -> tuple:
        params, dt = b.call
        return [self._flat(params, b.world, dt, b.local)], 1.0 / b.world  # in the units DeepSpeed divides to

    def dense(self, b: Bucket) -> List[torch.Tensor]:
        return self._dense(*b.call)

    def prepare(self, b: Bucket, step: int) -> Send:
        """The rank-major bucket; rank ``r`` owns its chunks, the range ``[r·per, (r+1)·per)``."""
        params, dt = b.call
        world, per = b.world, sum(b.local)
        flat = self._flat(params, world, dt, b.local)
        ranges = [(r * per, per, r) for r in range(world)]
        b.local = _Prepared(b.local, flat)  # the rank-major copy is this reduction's own: decoded into
        return Send([flat], 1.0 / world, 1.0, ownership=RangeOwnership(flat.numel(), ranges, world),
                    into=b.pipeline.can_reduce_into([flat], dt))

    def write(self, b: Bucket, out: Optional[torch.Tensor]) -> List[torch.Tensor]:
        """This rank's chunk of each gradient, in the accumulation dtype (what ``partition_grads`` takes);
        ``out`` None: decoded into the rank-major copy."""
        chunks, flat = b.local
        out = flat if out is None else out
        params, rank, per = b.call[0], b.pipeline.backend.rank, sum(chunks)
        mine, parts, offset = out[rank * per:(rank + 1) * per], [], 0
        for p, c in zip(params, chunks):
            length = max(0, min(c, p.grad.numel() - rank * c))  # the last ranks' chunks may be short or empty
            parts.append(mine[offset:offset + length].to(self.optimizer.gradient_accumulation_dtype))
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
