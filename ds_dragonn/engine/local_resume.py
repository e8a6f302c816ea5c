"""Local steps resumed at another world size: every rank restarts from the last synchronised weights.

Each rank's state file holds its own replica (its mid-round weights and inner optimizer state) and θ_outer,
the weights of the last outer step, which every rank held alike. At another world size the replicas do not
map onto the ranks (and DeepSpeed loads rank 0's module weights into every rank), so :func:`keep_outer` keeps
θ_outer and the round count from a state that is otherwise reset, and :func:`restart_from_outer` (collective,
after every rank applied its file) gives every rank rank 0's θ_outer, the ranks that had no file included.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from ..feedback import segment_views
from ..outer import OuterStep
from . import state


def keep_outer(hook: Any, saved: dict, reasons: List[str]) -> None:
    """Where ``saved`` was reset only for another world size or rank, load its θ_outer and round count into
    ``hook.outer`` (else leave it empty)."""
    outer = saved.get("outer")
    if not all(r.startswith(("world size", "rank ")) for r in reasons) or not isinstance(outer, dict):
        return
    try:
        hook.outer.load_state_dict({**outer, "velocity": None}, hook.masters())
    except (ValueError, TypeError):
        hook.reset_extra_state()


@torch.no_grad()
def restart_from_outer(hook: Any, saved_worlds: List[Optional[int]]) -> None:
    """A checkpoint of another world size (``saved_worlds``: each rank's saved world size, None: no file):
    every rank's masters and θ_outer ← rank 0's θ_outer, and its round count, by one dense allreduce of rank 0's
    values and zeros; each rank keeps the inner optimizer state DeepSpeed loaded (rank 0's). A warning names
    everything that was reset. Nothing happens where the world size is the saved one."""
    rank, world = hook.where()
    saved = {w for w in saved_worlds if w is not None}
    if not saved or saved == {world}:
        return
    masters = hook.masters()
    backend = hook.pipeline(hook.group).backend
    info = torch.tensor([float(hook.outer.started), float(hook.outer.rounds)], dtype=torch.float64)
    flat = (torch.cat([a.reshape(-1) for a in hook.outer.anchor]) if hook.outer.started
            else torch.cat([m.detach().float().reshape(-1) for m in masters]))
    if world > 1:
        if rank != 0:
            info.zero_()
            flat.zero_()
        backend.all_reduce_sum_(info)  # x + 0 = x: rank 0's, exactly
    old = "/".join(str(w) for w in sorted(saved))
    if not info[0]:
        state.note(hook, f"[rank {rank}] DRAGONN: local steps resumed at world size {world} from a checkpoint of "
                         f"world size {old} saved before the rounds started: they start at the next local step")
        return
    if world > 1:
        backend.all_reduce_sum_(flat)
    hook.outer = OuterStep(hook.cfg.outer_lr)
    for m, w in zip(masters, segment_views(flat, masters)):
        m.copy_(w)
    hook.outer.start(masters)
    hook.outer.rounds = int(info[1])
    hook._masters_to_model()
    steps, warmup, h = int(hook.engine.global_steps), hook.cfg.warmup_steps, hook.cfg.local_steps
    nxt = steps + (h - (steps - warmup) % h)
    state.note(hook, f"[rank {rank}] DRAGONN: local steps resumed at world size {world} from a checkpoint of "
                     f"world size {old}: every rank restarts from the last synchronised weights θ_outer (after "
                     f"outer step {hook.outer.rounds}, rank 0's), not from its mid-round local weights; reset: "
                     f"the pseudo-gradient residuals and each rank's own replica (its local weights and inner "
                     f"optimizer state: every rank keeps the inner optimizer state DeepSpeed loaded, rank 0's); "
                     f"the next outer step comes at step {nxt} (a round of {nxt - steps} steps)")


__all__ = ["keep_outer", "restart_from_outer"]
