"""Which ranks share a node: the layout the node-aware exchange (``hierarchy: node``) is built on.

The deepspeed launcher runs ``LOCAL_SIZE`` ranks per node, numbered node by node (``launcher/launch.py``; torchrun
exports ``LOCAL_WORLD_SIZE``, Open MPI ``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH ``MPI_LOCALNRANKS``). Hostnames are not
used (ranks in network namespaces of one machine share one). Every rank's view is gathered and checked; a layout
that is not ``N`` equal nodes numbered node by node is refused (``node``) or falls back to flat (``auto``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, List, Mapping, NamedTuple, Optional, Tuple

import torch

from .base import CommBackend

#: environment variables that carry the ranks per node / the local rank, by launcher
_SIZE_VARS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


@dataclass(frozen=True)
class NodeLayout:
    """``nodes`` nodes of ``ranks_per_node`` ranks each, numbered node by node; this rank is ``rank``."""

    world_size: int
    ranks_per_node: int
    rank: int

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def node_ranks(self, node: int) -> List[int]:
        """The ranks of node ``node`` (its fast link)."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def cross_ranks(self, local_rank: int) -> List[int]:
        """The ranks with local index ``local_rank``, one per node (they exchange across the slow link)."""
        return list(range(local_rank, self.world_size, self.ranks_per_node))

    def __str__(self) -> str:
        return f"{self.nodes} nodes x {self.ranks_per_node} ranks"


class Resolved(NamedTuple):
    """What :func:`resolve_layout` decided: the layout (None: flat) and why, in words for the log."""
    layout: Optional[NodeLayout]
    reason: str


def _env_int(names, env: Mapping[str, str]) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value is not None and str(value).strip().isdigit():
            return int(value)
    return None


def launcher_view(env: Optional[Mapping[str, str]] = None) -> Tuple[Optional[int], Optional[int]]:
    """(ranks per node, local rank) as the launcher exported them, or None where it did not."""
    env = os.environ if env is None else env
    return _env_int(_SIZE_VARS, env), _env_int(_RANK_VARS, env)


def check_layout(views: List[List[int]], override: Optional[int]) -> Tuple[Optional[int], str]:
    """The ranks per node ``L`` every rank agrees on, or None and why not.

    Args:
        views: per rank, ``[ranks per node or 0, local rank or -1]`` (gathered from every rank, in rank order).
        override: ``advanced.ranks_per_node`` (then the launcher's count is not needed, its local ranks are
            still checked where given).
    """
    world = len(views)
    sizes = {override} if override is not None else {v[0] for v in views}
    if not sizes or min(sizes) <= 0:
        return None, "the launcher did not export the ranks per node (LOCAL_SIZE) on every rank"
    if len(sizes) > 1:
        return None, f"ranks report different ranks per node ({sorted(sizes)}): unequal nodes"
    size = sizes.pop()
    if world % size:
        return None, f"{world} ranks do not fill nodes of {size} ranks: unequal nodes"
    bad = [r for r, (_, local) in enumerate(views) if local >= 0 and local != r % size]
    if bad:
        what = (f"'advanced.ranks_per_node' {size} contradicts the launcher's local ranks" if override is not None
                else "ranks are not numbered node by node")
        return None, f"{what} (rank {bad[0]} has local rank {views[bad[0]][1]}, expected {bad[0] % size})"
    return size, ""


def resolve_layout(mode: str, backend: CommBackend, choose: Callable[..., Tuple[Optional[int], str]],
                   override: Optional[int] = None, env: Optional[Mapping[str, str]] = None) -> Resolved:
    """The node layout for ``hierarchy`` ``mode`` (``auto``, ``flat``, ``node``) over ``backend``'s group;
    ``choose(mode, ranks per node or None, world size, why)`` decides from what the ranks report
    (``plan.layout_choice``: flat for one rank per node or a single node).

    Collective (one small allgather) for ``auto`` and ``node``: every rank reaches the same decision. Over the
    ``mpi`` transport, where the launcher exported no ranks per node, MPI's shared-memory split gives them.

    Raises:
        ValueError: ``mode`` is ``node`` and the ranks are not ``N >= 2`` equal nodes of ``L >= 2`` ranks
            numbered node by node (the message says which).
    """
    if mode == "flat":
        return Resolved(None, "hierarchy 'flat'")
    size, local = launcher_view(env)
    source = "the launcher"
    if size is None and backend.name == "mpi":
        from .mpi_backend import shared_memory_view
        (size, local), source = shared_memory_view(), "MPI's shared-memory split"
    views = backend.all_gather_ints([size or 0, -1 if local is None else local], torch.device("cpu"))
    per_node, why = check_layout(views, override)
    per_node, why = choose(mode, per_node, backend.world_size, why)
    if per_node is None:
        return Resolved(None, f"flat: {why}")
    layout = NodeLayout(backend.world_size, per_node, backend.rank)
    return Resolved(layout, f"node-aware: {layout} ({'advanced.ranks_per_node' if override else source})")


def node_groups(layout: NodeLayout) -> Tuple[object, object]:
    """(this rank's node group, its cross-node group) as ``deepspeed.comm`` process groups. Every rank creates
    every group, in the same order (``torch.distributed.new_group`` is collective over the world)."""
    import deepspeed.comm as dist
    node = [dist.new_group(layout.node_ranks(i)) for i in range(layout.nodes)]
    cross = [dist.new_group(layout.cross_ranks(j)) for j in range(layout.ranks_per_node)]
    return node[layout.node], cross[layout.local_rank]


__all__ = ["NodeLayout", "Resolved", "check_layout", "launcher_view", "node_groups", "resolve_layout"]
