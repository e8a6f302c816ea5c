"""A benchmark baseline DeepSpeed does not have: the dense allreduce done node by node (the yardstick of a
topology-aware NCCL). Per gradient bucket, on every rank of ``N`` nodes × ``L`` ranks:

1. sum the flattened bucket inside the node (fp32, the fast link);
2. allreduce this rank's 1/L shard of it across nodes, among the ranks of its local index, in ``dtype``
   (bf16: half the bytes; every node's link carries ``2(N−1)/N`` shards of ``n/L`` per rank);
3. gather the L shards inside the node and divide by the world size.

Installed over ``engine.allreduce_bucket`` (DeepSpeed 0.19.8 ``runtime/engine.py``: the reduction under
``allreduce_gradients`` → ``buffered_allreduce_fallback`` → ``allreduce_and_copy``, the hook point of
``ds_dragonn/engine/stage0.py``) of a ZeRO-0 engine without DRAGONN, fp32 or bf16 (the bf16 optimizer's own
gradient bookkeeping around it stays DeepSpeed's); the layout is the launcher's
(``ds_dragonn.comm.topology.launcher_view``).
"""
from __future__ import annotations

import torch


def install(engine, dtype: torch.dtype = torch.bfloat16) -> str:
    """Replace ``engine.allreduce_bucket`` with the node-by-node dense allreduce; returns the layout in words.

    Averages over the world size (``gradient_average``; a ``gradient_predivide_factor`` ≠ 1 or
    ``prescale_gradients`` is refused).

    Raises:
        ValueError: the engine runs ZeRO 1-3 or DRAGONN, or with other gradient scaling, or the launcher
            exported no layout of several equal nodes of several ranks.
    """
    import deepspeed.comm as dist
    from ds_dragonn.comm.topology import NodeLayout, launcher_view, node_groups
    if engine.zero_optimization_stage() != 0 or getattr(engine, "dragonn", None) is not None:
        raise ValueError("--hier-dense: a dense ZeRO-0 engine only (no 'dragonn' block)")
    if not engine.gradient_average or engine.gradient_predivide_factor() != 1.0:
        raise ValueError("--hier-dense: averaging over the world size only (gradient_predivide_factor 1)")
    world, (per, _) = dist.get_world_size(), launcher_view()
    if per is None or per < 2 or world % per or world == per:
        raise ValueError(f"--hier-dense: needs several nodes of several ranks (ranks per node {per}, world {world})")
    layout = NodeLayout(world, per, dist.get_rank())
    node, cross = node_groups(layout)

    @torch.no_grad()
    def allreduce_bucket(bucket, dp_group=None, dp_world_size=None):
        tensor = engine.flatten(bucket)
        n = tensor.numel()
        shard = -(-n // per)
        flat = torch.zeros(shard * per, dtype=torch.float32, device=tensor.device)
        flat[:n].copy_(tensor)
        dist.all_reduce(flat, group=node)
        mine = flat[layout.local_rank * shard:(layout.local_rank + 1) * shard].to(dtype)
        dist.all_reduce(mine, group=cross)
        parts = list(torch.empty_like(flat).chunk(per))
        dist.all_gather(parts, mine.float().contiguous(), group=node)  # (gloo has no all_gather_into_tensor)
        tensor.copy_(torch.cat(parts)[:n].div_(world))
        return tensor

    engine.allreduce_bucket = allreduce_bucket
    return str(layout)
