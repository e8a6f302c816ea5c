"""Local steps' own state (each rank's replica), and a resume at another world size or node layout: every rank
restarts from the last synchronised weights.

Each rank's state file holds its own replica (:func:`replica_state`) and θ_outer. At another world size or node
layout the replicas do not map onto the ranks, so :func:`keep_outer` keeps θ_outer and the round count from a state
that is otherwise reset, and :func:`restart_from_outer` (collective) gives every rank rank 0's θ_outer.
"""
from __future__ import annotations

import copy
from typing import Any, List, Optional

import torch

from ..feedback import segment_views
from ..outer import OuterStep
from . import state
from .local_weights import from_rank0_


def replica_state(hook: Any) -> dict:
    """This rank's replica: its fp32 master weights and its inner optimizer's state, which differ between ranks
    (between nodes, node-aware) mid-round and which DeepSpeed saves from rank 0 only."""
    return {"masters": [m.detach().clone() for m in hook.masters()],
            "optimizer": copy.deepcopy(hook.optimizer.state_dict())}


@torch.no_grad()
def load_replica(hook: Any, replica: Any) -> None:
    """This rank's saved replica over what DeepSpeed loaded (rank 0's).

    Raises:
        ValueError: the saved replica does not match this engine's master weights.
    """
    masters = hook.masters()
    weights = replica.get("masters") if isinstance(replica, dict) else None
    if (not isinstance(weights, (list, tuple)) or len(weights) != len(masters)
            or any(not isinstance(w, torch.Tensor) or w.shape != m.shape for w, m in zip(weights, masters))):
        raise ValueError(f"the saved local-steps replica does not match this engine's {len(masters)} fp32 "
                         f"master weight tensors")
    for m, w in zip(masters, weights):
        m.copy_(w)
    hook.optimizer.load_state_dict(replica["optimizer"])
    hook._masters_to_model()


def keep_outer(hook: Any, saved: dict, reasons: List[str]) -> Optional[str]:
    """Where ``saved`` was reset only for another world size, rank or node layout (where the replicas started
    from), load its θ_outer and round count into ``hook.outer`` (else leave it empty).

    Returns:
        The node-layout change (``"hierarchy 2 nodes x 2 ranks (now flat)"``) for
        :func:`restart_from_outer`, or None.
    """
    outer = saved.get("outer")
    moved = next((r for r in reasons if r.startswith("hierarchy ")), None)
    if (not all(r.startswith(("world size", "rank ", "hierarchy ")) for r in reasons)
            or not isinstance(outer, dict)):
        return moved
    try:
        hook.outer.load_state_dict(outer, hook.masters())
    except (ValueError, TypeError):
        hook.reset_extra_state()
    return moved


@torch.no_grad()
def restart_from_outer(hook: Any, saved_worlds: List[Optional[int]], moved: Optional[str] = None) -> None:
    """A checkpoint of another world size (``saved_worlds``: each rank's saved world size, None: no file) or
    node layout (``moved``: the reset reason that names it, from :func:`keep_outer`; the same on every rank,
    since every rank read a file of one save, ``engine/checkpoint.py`` refusing incomplete ones): every rank's
    masters and θ_outer ← rank 0's θ_outer, and its round count, by one dense allreduce of rank 0's values and
    zeros; each rank keeps the inner optimizer state DeepSpeed loaded (rank 0's). A warning names everything
    that was reset. Nothing happens where the world size and the layout are the saved ones."""
    rank, world = hook.where()
    saved = {w for w in saved_worlds if w is not None}
    if (not saved or saved == {world}) and moved is None:
        return
    masters = hook.masters()
    backend = hook.pipeline(hook.group).backend
    info = torch.tensor([float(hook.outer.started), float(hook.outer.rounds)], dtype=torch.float64)
    flat = (torch.cat([a.reshape(-1) for a in hook.outer.anchor]) if hook.outer.started
            else torch.cat([m.detach().float().reshape(-1) for m in masters]))
    from_rank0_(info, backend)
    old = "/".join(str(w) for w in sorted(saved))
    since = (f"at world size {world} from a checkpoint of world size {old}" if saved != {world}
             else f"from a checkpoint of another node layout [{moved}]")
    if hook.cfg.outer_lr == "auto":  # √(workers) of this run, which may differ from the saved run's
        since += f" (outer_lr auto: {hook.outer_lr:.4g})"
    if not info[0]:
        state.note(hook, f"[rank {rank}] DRAGONN: local steps resumed {since} saved before the rounds started: they "
                         f"start at the next local step")
        return
    from_rank0_(flat, backend)
    hook.outer = OuterStep(hook.outer_lr)
    for m, w in zip(masters, segment_views(flat, masters)):
        m.copy_(w)
    hook.outer.start(masters)
    hook.held = False  # the masters are θ_outer itself now
    hook.outer.rounds = int(info[1])
    hook._masters_to_model()
    steps, warmup, h = int(hook.engine.global_steps), hook.cfg.warmup_steps, hook.cfg.local_steps
    nxt = steps + (h - (steps - warmup) % h)
    state.note(hook, f"[rank {rank}] DRAGONN: local steps resumed {since}: every rank restarts from the last "
                     f"synchronised weights θ_outer (after outer step {hook.outer.rounds}, rank 0's), not from its "
                     f"mid-round local weights; reset: the pseudo-gradient residuals and each rank's own replica "
                     f"(its local weights and inner optimizer state: every rank keeps the inner optimizer state "
                     f"DeepSpeed loaded, rank 0's); "
                     f"the next outer step comes at step {nxt} (a round of {nxt - steps} steps)")


def dense_again(hook: Any) -> None:
    """Collective. A resume inside this run's dense warm-up from a checkpoint whose rounds had started (a longer
    ``warmup_steps`` now): the ranks hold different replicas, and dense steps need one state, so every rank takes
    rank 0's weights and optimizer state (``before_disable``), with a note. Nothing happens otherwise."""
    steps = int(hook.engine.global_steps)
    if not hook.outer.started or steps >= hook.cfg.warmup_steps:
        return
    hook.before_disable()
    state.note(hook, f"[rank {hook.where()[0]}] DRAGONN: local steps resumed at step {steps}, inside this run's "
                     f"dense warm-up of {hook.cfg.warmup_steps} steps, from a checkpoint whose rounds had started: "
                     f"every rank takes rank 0's weights and optimizer state for the dense steps")


__all__ = ["dense_again", "keep_outer", "load_replica", "replica_state", "restart_from_outer"]
