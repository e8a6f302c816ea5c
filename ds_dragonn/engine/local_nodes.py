"""``sync: local_steps`` on the node-aware hierarchy: each node is one DiLoCo worker (INTELLECT-1's hybrid).

Between syncs the L ranks of a node average their gradients densely every step over the node's group only
(:func:`node_average_`); every H steps the outer step runs through :class:`~ds_dragonn.hierarchy.NodeAllreduce`
across nodes. See docs/design.md, 'Local steps: ``"sync": "local_steps"``'.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from ..comm.base import CommBackend
from ..comm.topology import NodeLayout
from ..exchange.wire import dense_allreduce_bytes
from ..feedback import segment_views


def node_gradients(module: torch.nn.Module) -> List[torch.Tensor]:
    """The gradients a node averages: every trainable, non-empty parameter's, in the module's order (a missing
    gradient becomes zeros, as DeepSpeed's ``_get_gradients_for_reduction`` does, so every rank reduces the same
    buffer)."""
    grads = []
    for p in module.parameters():
        if not p.requires_grad or p.numel() == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.data)
    return grads


@torch.no_grad()
def node_average_(grads: Sequence[torch.Tensor], node: CommBackend, average: bool = True) -> int:
    """Average (``average``; else sum) ``grads`` in place over the node's ranks: one flat buffer per dtype, in
    fp32 for 16-bit gradients (float64 stays float64), one allreduce each over ``node``.

    Returns:
        The bytes this rank sent (a ring allreduce of each buffer over the node's L ranks).
    """
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for g in grads:  # the module's order: every rank builds the same buffers
        by_dtype.setdefault(g.dtype, []).append(g)
    sent = 0
    for dtype, group in by_dtype.items():
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        flat = torch.cat([g.reshape(-1).to(wide) for g in group])
        node.all_reduce_sum_(flat)
        if average:
            flat.div_(node.world_size)
        for g, v in zip(group, segment_views(flat, group)):
            g.copy_(v)
        sent += dense_allreduce_bytes(flat.numel(), flat.element_size(), node.world_size)
    return sent


def describe(layout: NodeLayout, local_steps: int) -> str:
    """The start-up line's words for the hybrid."""
    return (f"DRAGONN local steps on {layout}: each node is one DiLoCo worker: dense gradient allreduce inside the "
            f"node every step ({layout.ranks_per_node} ranks, the fast link), outer step across the {layout.nodes} "
            f"nodes every {local_steps} steps")


__all__ = ["describe", "node_average_", "node_gradients"]
