"""The node-aware compressed allreduce (``hierarchy: node``): dense inside the node, compressed across nodes.

With N nodes of L ranks (``comm/topology.py``), per bucket: sum densely inside the node and keep this rank's
``ceil(n / L)`` shard; compensate, select and exchange that shard among the N ranks of this local index
(:class:`~ds_dragonn.pipeline.CompressedAllreduce`); decode it and gather the L shards back inside the node.
HiTopKComm (Shi et al., MLSys'21) and ZeRO++ qgZ (DeepSpeed ``runtime/comm/coalesced_collectives.py``
``all_to_all_quant_reduce``) do the same with top-k and int4. The momentum mode needs nothing more (the node's
sum of local momenta is linear). The node's sum is an allreduce, not a reduce-scatter: twice the bytes, on the
fast link, through the four collectives every transport has (``comm/base.py``). Nothing is lost
(``tests/test_hierarchy.py``, float64). See docs/design.md, 'The exchange schemes' (Across nodes).
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from .comm.base import CommBackend
from .comm.topology import NodeLayout
from .exchange import check_buffer_agreement
from .exchange.quantize import PLAIN, ValueCodec
from .exchange.wire import dense_allreduce_bytes
from .pipeline import CompressedAllreduce, PhaseClock, Reduced


def shard_key(key: Hashable, layout: NodeLayout, numel: int) -> Hashable:
    """The residual key of this rank's shard of bucket ``key``: the bucket's with the shard's length and the
    layout in its digest (another layout or local rank never takes this residual)."""
    if isinstance(key, tuple) and hasattr(key, "_replace"):
        return key._replace(numel=numel, layout=f"{key.layout}.n{layout.ranks_per_node}l{layout.local_rank}")
    return (key, "shard", layout.ranks_per_node, layout.local_rank)


class NodeAllreduce:
    """The node-aware compressed allreduce of one data-parallel group (module docstring); it serves the hooks
    as :class:`~ds_dragonn.pipeline.CompressedAllreduce` does.

    Args:
        cross: the shard's pipeline over the N ranks of this local index (its residuals, momentum, exchange).
        node: collectives over the L ranks of this node.
        full: collectives over the whole data-parallel group (agreement checks, the auto policy's decisions).
        layout: the node layout.
    """

    def __init__(self, cross: CompressedAllreduce, node: CommBackend, full: CommBackend, layout: NodeLayout):
        self.cross, self.node, self.backend, self.layout = cross, node, full, layout
        self.exchange = cross.exchange
        self.error_feedback = cross.error_feedback
        self.compressor = cross.compressor
        self._agreed: set = set()

    def can_reduce_into(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> bool:
        """Never: the result comes back through the node's gather."""
        return False

    def _node_shard(self, tensors: Sequence[torch.Tensor], prescale: float) -> tuple:
        """(the node's sum of ``prescale × tensors``, fp32 or wider, padded to L·s; s; n)."""
        tensors = list(tensors)
        n = sum(t.numel() for t in tensors)
        per = -(-n // self.layout.ranks_per_node)
        dtype = torch.float64 if tensors and tensors[0].dtype == torch.float64 else torch.float32
        device = tensors[0].device if tensors else torch.device("cpu")
        flat = torch.zeros(per * self.layout.ranks_per_node, dtype=dtype, device=device)
        if n:
            torch.cat([t.reshape(-1).to(dtype) for t in tensors], out=flat[:n])
            if prescale != 1.0:
                flat.mul_(prescale)
        self.node.all_reduce_sum_(flat)
        lo = self.layout.local_rank * per
        return flat[lo:lo + per].clone(), per, n

    def _gather(self, shard: torch.Tensor, n: int) -> torch.Tensor:
        """The node's L shards (``shard`` is this rank's), concatenated and cut to ``n``."""
        payload = shard.contiguous().view(torch.uint8)
        return self.node.all_gather_bytes(payload).reshape(-1).view(shard.dtype)[:n]

    def shard_view(self, key: Hashable, tensors: Sequence[torch.Tensor], prescale: float) -> tuple:
        """``(shard key, [this rank's shard of the node's sum], 1.0)``: where the hook folds gradients into the
        momentum outside a reduction (the dense warm-up, a variance refresh). One dense allreduce in the node."""
        shard, per, _ = self._node_shard(tensors, prescale)
        return shard_key(key, self.layout, per), [shard], 1.0

    def reduce(self, tensors, key: Hashable, seed: int, prescale: float = 1.0, postscale: float = 1.0,
               dtype: torch.dtype | None = None, into_inputs: bool = False,
               ownership=None, age_step: int | None = None) -> Reduced:
        """:meth:`CompressedAllreduce.reduce <ds_dragonn.pipeline.CompressedAllreduce.reduce>` of the bucket
        ``tensors`` through the node (module docstring); ``out`` is a new (n,) tensor of ``dtype``, and the
        statistics count the shard's selection and the cross-node bytes (``dense_bytes``: a flat ring
        allreduce of the whole bucket over every rank; ``exchange_ms`` includes the node's collectives)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        dtype = dtype or (tensors[0].dtype if tensors else torch.float32)
        n = sum(t.numel() for t in tensors)
        if (key, n, dtype) not in self._agreed:
            device = tensors[0].device if tensors else torch.device("cpu")
            check_buffer_agreement(n, dtype, self.backend, device, f"node/{self.exchange.name}", key)
            self._agreed.add((key, n, dtype))
        clock = PhaseClock(tensors[0].device if tensors else torch.device("cpu"))
        shard, per, n = self._node_shard(tensors, prescale)
        node_ms = clock.lap()
        # the shard is this reduction's own: decoded into where it can (no decode buffer per shard)
        into = self.cross.can_reduce_into([shard], dtype)
        out, stats = self.cross.reduce([shard], shard_key(key, self.layout, per), seed, 1.0, postscale, dtype,
                                      into_inputs=into, age_step=age_step)
        out = shard if into else out
        clock.lap()
        full = self._gather(out, n)
        node_ms += clock.lap()  # the node's collectives count as exchange time, with the cross-node exchange
        return Reduced(full, stats._replace(dense_bytes=dense_allreduce_bytes(n, dtype.itemsize, self.backend.world_size),
                                            exchange_ms=stats.exchange_ms + node_ms))

    def residual_of(self, key: Hashable, numel: int, device: torch.device) -> torch.Tensor | None:
        """The node's residual of bucket ``key``: its L shards' residuals gathered inside the node, (numel,) float32
        (in the units of the node's sum), or None before the bucket's first compressed reduction. Collective over
        the node (``device``: where its collectives run)."""
        per = -(-numel // self.layout.ranks_per_node)
        shard = self.cross.residual_of(shard_key(key, self.layout, per), per, device)
        present = self.node.all_gather_ints([int(shard is not None)], device)
        if not all(p[0] for p in present):  # every rank of the node takes the same branch
            return None
        return self._gather(shard, numel)

    def release(self, key: Hashable) -> None:
        """Free this rank's shard residual of bucket ``key`` (a :class:`BucketKey`); what it held is dropped."""
        self.cross.release(shard_key(key, self.layout, -(-key.numel // self.layout.ranks_per_node)))

    def reduce_dense(self, tensors: Sequence[torch.Tensor], key: Hashable, prescale: float = 1.0,
                     postscale: float = 1.0, dtype: torch.dtype | None = None, codec: ValueCodec = PLAIN,
                     raw: bool = False, flush: bool = False) -> torch.Tensor:
        """A dense reduction that also empties the shard's residual (the flat pipeline's ``reduce_dense``, per
        shard): the node's sum, then the shard plus its residual across nodes, gathered inside the node.
        ``codec``, ``raw`` and ``flush`` as there: only the cross-node sum travels quantized (the node's is dense)."""
        tensors = list(tensors)
        dtype = dtype or tensors[0].dtype
        shard, per, n = self._node_shard(tensors, prescale)
        out = self.cross.reduce_dense([shard], shard_key(key, self.layout, per), 1.0, postscale, dtype, codec, raw,
                                      flush)
        return self._gather(out, n)


__all__ = ["NodeAllreduce", "shard_key"]
