"""The pipeline a hook reduces a data-parallel group's buckets with: flat, or node-aware (``hierarchy``).

``hierarchy`` ``auto`` resolves to the node-aware pipeline (``ds_dragonn/hierarchy.py``) on several nodes of
several ranks where the hook supports it (ZeRO stages 0-3, local steps, either transport, the data-parallel group
being the world), else to the flat one; the choice and its reason are logged once.
``node`` where it cannot run is refused at ``initialize``, naming the reason.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from deepspeed.utils.logging import print_dist

from ..comm import build_backend
from ..comm.base import CommBackend
from ..comm.topology import NodeLayout, node_groups, resolve_layout
from ..config import CommBackendName, Hierarchy
from ..exchange.quantize import value_codec
from ..exchange.wire import dense_allreduce_bytes
from ..hierarchy import NodeAllreduce
from ..pipeline import CompressedAllreduce, PhaseClock
from ..plan import Facts, check, layout_choice, node_unsupported
from .local_nodes import describe, node_average_, node_gradients


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
        resolved = resolve_layout(mode.value, backend, layout_choice, hook.cfg.ranks_per_node)
    except ValueError as err:
        raise HierarchyUnsupported(str(err)) from None
    print_dist(f"DRAGONN: hierarchy '{mode.value}' -> {resolved.reason}", ranks=[0])
    return resolved.layout


def _exchange(exchange: Any, hook: Any) -> Any:
    """``exchange`` (the hook's, over a backend) with its values in the format of ``advanced.values`` (every
    scheme: also ZeRO's reduce-scatter, which the stage hooks build)."""
    exchange.values = value_codec(hook.cfg.values)
    return exchange


class FlatLayout:
    """The flat pipeline over the whole data-parallel group with the hook's flat exchange; under local steps each
    rank is one worker. :class:`NodeAware` has the same methods: a hook asks its ``topology`` instead of testing
    for a node layout."""

    layout: Optional[NodeLayout] = None  # (``hook.layout``)

    def build(self, hook: Any, backend: CommBackend) -> CompressedAllreduce:
        return CompressedAllreduce(hook.compressor, backend, hook.error_feedback,
                                   _exchange(hook._flat_exchange(backend), hook), hook.mode.target, hook.cfg.max_age)

    def exchange_name(self, hook: Any) -> str:
        return hook.flat_exchange_name

    def scheme(self, hook: Any) -> str:
        return hook.flat_scheme

    # -- local steps (engine/local_steps.py, local_nodes.py) --------------------------------------------
    def workers(self, hook: Any) -> int:
        return hook.where()[1]

    def announce(self, local_steps: int) -> None:
        pass

    def between_syncs(self, hook: Any) -> None:
        pass

    def outer_dense_bytes(self, numel: int, itemsize: int, world: int) -> int:
        """Bytes a rank sends across the slow link in a dense outer step of ``numel`` elements: flat, a ring
        allreduce over every rank."""
        return dense_allreduce_bytes(numel, itemsize, world)

    def per_worker(self, held: torch.Tensor) -> torch.Tensor:
        return held


class NodeAware(FlatLayout):
    """The node-aware pipeline (:class:`~ds_dragonn.hierarchy.NodeAllreduce` on ``layout``): dense inside the
    node, the shard compressed across nodes with ``exchange``; under local steps each node is one worker, its ranks
    averaging their gradients between syncs (``engine/local_nodes.py``)."""

    def __init__(self, layout: NodeLayout):
        self.layout = layout

    def build(self, hook: Any, backend: CommBackend) -> NodeAllreduce:
        """A :class:`~ds_dragonn.hierarchy.NodeAllreduce` whose shard pipeline runs over the ranks of this local
        index."""
        layout = self.layout
        node_group, cross_group = node_groups(layout)
        node_comm = cross_comm = None
        if hook.cfg.comm_backend == CommBackendName.mpi:  # MPI communicators of the same ranks
            from ..comm.mpi_backend import split_comm
            node_comm = split_comm(layout.node, layout.local_rank)
            cross_comm = split_comm(layout.local_rank, layout.node)
        cross = build_backend(hook.cfg, cross_group, cross_comm)
        shard = CompressedAllreduce(hook.compressor, cross, hook.error_feedback,
                                    _exchange(hook._build_exchange(cross), hook), hook.mode.target, hook.cfg.max_age)
        return NodeAllreduce(shard, build_backend(hook.cfg, node_group, node_comm), backend, layout)

    def exchange_name(self, hook: Any) -> str:
        return hook.cfg.exchange.value

    def scheme(self, hook: Any) -> str:
        return f"node-aware {hook.cfg.exchange.value} across nodes, {hook.node_scheme}"

    def workers(self, hook: Any) -> int:
        return self.layout.nodes

    def announce(self, local_steps: int) -> None:
        print_dist(describe(self.layout, local_steps), ranks=[0])

    def between_syncs(self, hook: Any) -> None:
        """At each accumulation boundary the node's ranks average their gradients (``local_nodes.node_average_``)."""
        engine = hook.engine
        if engine.is_gradient_accumulation_boundary():
            clock = PhaseClock(engine.device)
            sent = node_average_(node_gradients(engine.module), hook.pipeline(hook.group).node,
                                 average=bool(getattr(engine, "gradient_average", True)))
            hook.reporter.node_average(sent, clock.lap())

    def outer_dense_bytes(self, numel: int, itemsize: int, world: int) -> int:
        """Across the slow link: the shard's allreduce over the N ranks of this local index."""
        return dense_allreduce_bytes(-(-numel // self.layout.ranks_per_node), itemsize, self.layout.nodes)

    def per_worker(self, held: torch.Tensor) -> torch.Tensor:
        """The node's L identical Δ were summed into the residual ``held``: divided by L."""
        return held / self.layout.ranks_per_node


#: the layout before a hook's first pipeline is built
FLAT = FlatLayout()


def build_pipeline(hook: Any, backend: CommBackend) -> Any:
    """A :class:`~ds_dragonn.pipeline.CompressedAllreduce` over ``backend``, or a
    :class:`~ds_dragonn.hierarchy.NodeAllreduce` (:func:`node_layout`); sets ``hook.topology`` (the
    :class:`FlatLayout` or :class:`NodeAware` that built it) and ``hook.layout``."""
    layout = node_layout(hook, backend)
    hook.topology = FLAT if layout is None else NodeAware(layout)
    hook.layout = layout
    return hook.topology.build(hook, backend)


__all__ = ["FLAT", "FlatLayout", "HierarchyUnsupported", "NodeAware", "build_pipeline", "node_layout"]
