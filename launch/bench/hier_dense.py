"""A benchmark baseline DeepSpeed does not have: the dense allreduce done node by node (the yardstick of a
topology-aware NCCL). Per step, on every rank of ``N`` nodes × ``L`` ranks:

1. sum the flattened gradients inside the node (fp32, the fast link);
2. allreduce this rank's 1/L shard of it across nodes, among the ranks of its local index, in ``dtype``
   (bf16: half the bytes; every node's link carries ``2(N−1)/N`` shards of ``n/L`` per rank);
3. gather the L shards inside the node and divide by the world size.

Installed over ``engine.allreduce_gradients`` (DeepSpeed 0.19.8 ``runtime/engine.py``) of a ZeRO-0 fp32
engine without DRAGONN; the layout is the launcher's (``ds_dragonn.comm.topology``).
"""
from __future__ import annotations

import os

import torch


def install(engine, dtype: torch.dtype = torch.bfloat16) -> str:
    """Replace ``engine.allreduce_gradients`` with the node-by-node dense allreduce; returns the layout in words.

    Raises:
        ValueError: the engine runs ZeRO 1-3 or DRAGONN, or the launcher exported no layout of several
            equal nodes of several ranks.
    """
    import deepspeed.comm as dist
    from ds_dragonn.comm.topology import NodeLayout, node_groups
    if engine.zero_optimization_stage() != 0 or getattr(engine, "dragonn", None) is not None:
        raise ValueError("--hier-dense: a dense ZeRO-0 engine only (no 'dragonn' block)")
    world, per = dist.get_world_size(), int(os.environ.get("LOCAL_SIZE", "0"))
    if per < 2 or world % per or world == per:
        raise ValueError(f"--hier-dense: needs several nodes of several ranks (LOCAL_SIZE={per}, world {world})")
    layout = NodeLayout(world, per, dist.get_rank())
    node, cross = node_groups(layout)

    @torch.no_grad()
    def allreduce_gradients(*args, **kwargs):
        if not engine.is_gradient_accumulation_boundary():
            return
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        n = sum(g.numel() for g in grads)
        shard = -(-n // per)
        flat = torch.zeros(shard * per, dtype=torch.float32, device=grads[0].device)
        torch.cat([g.reshape(-1).float() for g in grads], out=flat[:n])
        dist.all_reduce(flat, group=node)
        mine = flat[layout.local_rank * shard:(layout.local_rank + 1) * shard].to(dtype)
        dist.all_reduce(mine, group=cross)
        parts = list(torch.empty_like(flat).chunk(per))
        dist.all_gather(parts, mine.float().contiguous(), group=node)  # (gloo has no all_gather_into_tensor)
        out = torch.cat(parts).div_(world)
        offset = 0
        for g in grads:
            g.copy_(out[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    engine.allreduce_gradients = allreduce_gradients
    return str(layout)
