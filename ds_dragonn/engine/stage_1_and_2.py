"""ZeRO stage 1 and 2: the hook on the ZeRO optimizer's gradient reduce-scatter.

Hook point (DeepSpeed 0.19.8 ``runtime/zero/stage_1_and_2.py``): ``DeepSpeedZeroOptimizer.average_tensor(tensor,
communication_data_type)``, overridden on the optimizer *instance*. The override runs DeepSpeed's own method with
its reductions (``allreduce_no_retain``, ``allreduce_and_scatter``) replaced by recorders, so DeepSpeed applies
the averaging and computes the owners (``rank_and_offsets``); the bucket then goes through the pipeline with
:class:`~ds_dragonn.exchange.reduce_scatter.ReduceScatterExchange` (node-aware: ``hierarchy.NodeAllreduce``),
and each owner writes the sum where DeepSpeed's ``allreduce_and_copy`` would. Anything else
recorded (Muon, MoE expert groups) is replayed through DeepSpeed's own methods. See docs/design.md, 'Where it
hooks into DeepSpeed'.
"""
from __future__ import annotations

import hashlib
from typing import Any, List, NamedTuple, Optional

import torch

from ..exchange.reduce_scatter import RangeOwnership
from ..exchange.wire import dense_allreduce_bytes, dense_reduce_scatter_bytes
from .base import ZeroPartitionHook
from .bucket import REDUCE_SCATTER, BucketKey
from .reducer import Bucket, Send

_RECORDED = ("allreduce_no_retain", "allreduce_and_scatter")


class _Call(NamedTuple):
    """One reduction DeepSpeed's ``average_tensor`` asked for."""
    method: str
    args: tuple
    kwargs: dict


class Stage12Hook(ZeroPartitionHook):
    """ZeRO stage 1/2: compresses ``DeepSpeedZeroOptimizer.average_tensor`` with a sparse reduce-scatter."""

    flat_scheme = "reduce_scatter (ZeRO partitions)"
    node_scheme = "ZeRO partitions from the node's sum"
    hook_name = "ZeRO stage 1/2 reduce-scatter"

    def __init__(self, engine: Any, cfg):
        super().__init__(engine, cfg)
        self._dense_average_tensor = self.optimizer.average_tensor  # DeepSpeed's bound method

    def _patch(self) -> None:
        self.optimizer.average_tensor = self.average_tensor


    # -- the hook -----------------------------------------------------------------------------------
    def average_tensor(self, tensor: torch.Tensor, communication_data_type: torch.dtype):
        """Drop-in for ``DeepSpeedZeroOptimizer.average_tensor``: averages ``tensor`` (the flattened IPG
        bucket, (n,)) over the data-parallel group into the slices this rank owns."""
        if tensor.numel() == 0:  # ZeRO-1 flushes an empty bucket at the boundary: nothing to reduce or count
            return self._dense_average_tensor(tensor, communication_data_type)
        return self.reducer.reduce((tensor, communication_data_type))

    # -- the stage adapter (engine/reducer.py) ------------------------------------------------------
    def describe(self, call, step: int) -> Bucket:
        """``call``: (the flattened IPG bucket, the communication dtype)."""
        tensor, dt = call
        ordinal = self._next_ordinal((step, int(self.engine.micro_steps)))
        numel = tensor.numel()
        pipeline = self.pipeline(self.optimizer.dp_process_group)
        key = BucketKey(REDUCE_SCATTER, ordinal, str(dt), numel, self._layout(dt))
        return Bucket(key, ordinal, numel, dt, pipeline, tensor.device, call,
                      dense_bytes=self._dense_bytes(numel, dt.itemsize, pipeline.backend.world_size))

    def momentum_input(self, b: Bucket) -> tuple:
        return [b.call[0]], 1.0 / b.world  # in the units DeepSpeed divides to

    def dense(self, b: Bucket):
        return self._dense_average_tensor(*b.call)

    def prepare(self, b: Bucket, step: int) -> Optional[Send]:
        """DeepSpeed divides the bucket and names the owners (its reductions recorded, not run); slices this
        hook does not model go through DeepSpeed's own dense reductions, unchanged (None)."""
        tensor, dt = b.call
        calls = self._record_reductions(tensor, dt)
        mine, ranges, other = self._owners(tensor, calls, b.pipeline.backend.rank)
        if other:
            self.mode.refuse_unmodelled(step, "gradient slices reduced outside the data-parallel group or owned by "
                                              "several ranks (MoE experts, Muon)")
            for call in calls:
                getattr(self.optimizer, call.method)(*call.args, **call.kwargs)
            return None
        b.local = mine
        # DeepSpeed's bucket buffer is ours for this reduction: decode into it (no decode buffer)
        return Send([tensor], 1.0, 1.0, ownership=RangeOwnership(b.numel, ranges, b.world),
                    into=b.pipeline.can_reduce_into([tensor], b.dtype))

    def write(self, b: Bucket, out: Optional[torch.Tensor]) -> None:
        """What DeepSpeed's ``allreduce_and_copy`` does on the owner: the compact partition gets the
        reduced slice added, the bucket slice gets it copied (``out`` None: decoded into the bucket itself)."""
        opt = self.optimizer
        out = b.call[0] if out is None else out
        for start, buf, output in b.local:
            synced = out[start:start + buf.numel()].view_as(buf)
            opt._add_to_grad_partition_buffer(output, synced)
            if synced.data_ptr() != buf.data_ptr():
                buf.copy_(synced)

    def _dense_bytes(self, numel: int, itemsize: int, world: int) -> int:
        """Bytes DeepSpeed's own reduction of a bucket sends per rank: an allreduce
        (``use_multi_rank_bucket_allreduce``, its default) or a reduce to each owner (≈ a reduce-scatter)."""
        if getattr(self.optimizer, "use_multi_rank_bucket_allreduce", True):
            return dense_allreduce_bytes(numel, itemsize, world)
        return dense_reduce_scatter_bytes(numel, itemsize, world)

    def _record_reductions(self, tensor: torch.Tensor, dt: torch.dtype) -> List[_Call]:
        """Run DeepSpeed's ``average_tensor`` with its reductions recorded instead of run."""
        opt, calls = self.optimizer, []
        saved = {name: opt.__dict__.get(name) for name in _RECORDED}
        for name in _RECORDED:
            setattr(opt, name, lambda *a, _name=name, **kw: calls.append(_Call(_name, a, kw)))
        try:
            self._dense_average_tensor(tensor, dt)
        finally:
            for name, value in saved.items():
                if value is None:
                    delattr(opt, name)
                else:
                    setattr(opt, name, value)
        return calls

    def _owners(self, tensor: torch.Tensor, calls: List[_Call], rank: int):
        """(this rank's (start, slice, output) triples, (start, length, owner) ranges, whether a call asked for
        something this hook does not model).

        DeepSpeed asks as ``allreduce_and_scatter([(copy_ranks, slice, output), ...])`` (the default) or
        ``allreduce_no_retain(slices, rank=dst, output_bucket=outputs)``. A slice with one consumer rank is that
        rank's; slices shared by several ranks (Muon) or reduced in another process group (MoE) are not modelled.
        """
        base, size = tensor.data_ptr(), tensor.element_size()
        dp = self.optimizer.dp_process_group
        mine, ranges, other = [], [], False
        for call in calls:
            group = call.kwargs.get("process_group")
            if group is not None and group is not dp:
                other = True
                continue
            if call.method == "allreduce_and_scatter":
                items = [(e[0], e[1], e[2] if len(e) > 2 else None) for e in call.args[0]]
            else:
                dst = call.kwargs.get("rank")
                outputs = call.kwargs.get("output_bucket") or [None] * len(call.args[0])
                items = [(dst, buf, out) for buf, out in zip(call.args[0], outputs)]
            for owner, buf, output in items:
                if isinstance(owner, frozenset):
                    owner = next(iter(owner)) if len(owner) == 1 else None
                if owner is None:
                    other = True
                    continue
                start = (buf.data_ptr() - base) // size
                ranges.append((start, buf.numel(), int(owner)))
                if int(owner) == rank:
                    mine.append((start, buf, output))
        return mine, ranges, other

    def _layout(self, dt: torch.dtype) -> str:
        """Digest of the IPG bucket's parameters (ids and shapes), part of the residual's key."""
        bucket = self.optimizer.ipg_buckets[dt]
        params = self.optimizer.bit16_groups
        layout = repr(tuple((pid, tuple(params[g][i].shape)) for g, i, pid in bucket.params))
        return hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()


def check_zero_hook_point(optimizer_cls: Optional[type] = None) -> None:
    """Fail loudly if a DeepSpeed upgrade changes what :class:`Stage12Hook` relies on in ZeRO stage 1/2.

    Checks that ``average_tensor`` (replaced), ``reduce_ipg_grads`` (its caller) and the methods the hook calls
    for DeepSpeed's dense path and owner write-back exist with the parameters the hook passes.
    """
    from .probes import require_methods
    if optimizer_cls is None:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as optimizer_cls
    require_methods(optimizer_cls, {
        "reduce_ipg_grads": (),
        "average_tensor": ("tensor", "communication_data_type"),
        "allreduce_no_retain": ("bucket", "communication_data_type", "numel_per_bucket", "rank"),
        "allreduce_and_scatter": ("bucket", "communication_data_type"),
        "allreduce_and_copy": ("small_bucket", "communication_data_type", "rank"),
        "allreduce_and_copy_with_multiple_ranks": ("small_bucket", "communication_data_type"),
        "_add_to_grad_partition_buffer": (),
    }, "ds_dragonn's ZeRO-1/2 hook would be bypassed or wrong")


__all__ = ["Stage12Hook", "check_zero_hook_point"]
