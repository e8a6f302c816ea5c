"""The pipeline a hook reduces a data-parallel group's buckets with: flat, or node-aware (``hierarchy``).

``hierarchy`` ``auto`` resolves to the node-aware pipeline (``ds_dragonn/hierarchy.py``) on several nodes of
several ranks where the hook supports it (ZeRO stages 0-3, local steps, either transport, the data-parallel group
being the world), else to the flat one; the choice and its reason are logged once.
``node`` where it cannot run is refused at ``initialize``, naming the reason.
"""
from __future__ import annotations

from typing import Any, Optional

from deepspeed.utils.logging import print_dist

from ..comm import build_backend
from ..comm.base import CommBackend
from ..comm.topology import NodeLayout, node_groups, resolve_layout
from ..config import CommBackendName, Hierarchy
from ..exchange.quantize import value_codec
from ..hierarchy import NodeAllreduce
from ..pipeline import CompressedAllreduce
from ..plan import Facts, check, node_unsupported


class HierarchyUnsupported(ValueError):
    """``hierarchy: node`` where the node-aware exchange cannot run (the message says why)."""


def _layout_facts(hook: Any, backend: CommBackend) -> Facts:
    """The facts of ``plan.RULES``' layout phase for this hook and group."""
    import deepspeed.comm as dist
    return Facts(hook_name=hook.hook_name, supports_hierarchy=bool(getattr(hook, "supports_hierarchy", False)),
                 dp_world=backend.world_size, world=dist.get_world_size() if backend.world_size > 1 else None)


def node_layout(hook: Any, backend: CommBackend) -> Optional[NodeLayout]:
    """The node layout this hook's pipeline runs on (None: flat), decided once and logged.

    Raises:
        HierarchyUnsupported: ``hierarchy: node`` where it cannot run (the ``node_layout`` row of
            ``plan.RULES``, or not several nodes of several ranks).
    """
    mode = hook.cfg.hierarchy
    if mode == Hierarchy.flat:
        return None
    facts = _layout_facts(hook, backend)
    check(hook.cfg, facts, "layout", error=HierarchyUnsupported)
    why = node_unsupported(facts)
    if why is not None:  # (auto)
        print_dist(f"DRAGONN: hierarchy 'auto' -> flat: {why}", ranks=[0])
        return None
    try:
        resolved = resolve_layout(mode.value, backend, hook.cfg.ranks_per_node)
    except ValueError as err:
        raise HierarchyUnsupported(str(err)) from None
    print_dist(f"DRAGONN: hierarchy '{mode.value}' -> {resolved.reason}", ranks=[0])
    return resolved.layout


def _exchange(hook: Any, backend: CommBackend) -> Any:
    """The hook's exchange over ``backend``, its values in the format of ``advanced.values`` (every scheme:
    also ZeRO's reduce-scatter, which the stage hooks build)."""
    exchange = hook._build_exchange(backend)
    exchange.values = value_codec(hook.cfg.values)
    return exchange


def build_pipeline(hook: Any, backend: CommBackend) -> Any:
    """A :class:`~ds_dragonn.pipeline.CompressedAllreduce` over ``backend``, or a
    :class:`~ds_dragonn.hierarchy.NodeAllreduce` whose shard pipeline runs over the ranks of this local index."""
    layout = node_layout(hook, backend)
    hook.layout = layout
    if layout is None:
        return CompressedAllreduce(hook.compressor, backend, hook.error_feedback, _exchange(hook, backend),
                                   hook.mode.target, hook.cfg.max_age)
    node_group, cross_group = node_groups(layout)
    node_comm = cross_comm = None
    if hook.cfg.comm_backend == CommBackendName.mpi:  # MPI communicators of the same ranks
        from ..comm.mpi_backend import split_comm
        node_comm, cross_comm = split_comm(layout.node, layout.local_rank), split_comm(layout.local_rank, layout.node)
    cross = build_backend(hook.cfg, cross_group, cross_comm)
    shard = CompressedAllreduce(hook.compressor, cross, hook.error_feedback, _exchange(hook, cross), hook.mode.target,
                                hook.cfg.max_age)
    return NodeAllreduce(shard, build_backend(hook.cfg, node_group, node_comm), backend, layout)


__all__ = ["HierarchyUnsupported", "build_pipeline", "node_layout"]
