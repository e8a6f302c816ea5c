"""Multi-rank cases of the node-aware exchange (``hierarchy: node``, ds_dragonn/hierarchy.py), for
``tests/test_hierarchy.py``; executed inside each rank by ``tests.multiproc.run_ranks`` with ``LOCAL_SIZE``
set, as the deepspeed launcher sets it, so that 4 ranks on one host are 2 nodes of 2 ranks."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.engines import init_distributed, train_mlp, zero_config

#: pipeline cases: (exchange, numel, density); float64 buckets. 1001 is not divisible by 2 ranks per node,
#: 7 gives shards below one pair's worth, 0 is empty
PIPE_CASES = [("allgather", 1000, 0.05), ("partitioned", 1001, 0.05), ("allgather", 7, 0.5), ("allgather", 0, 0.1),
              ("allgather", 1000, 1.0)]
STEPS = 4


def set_layout(rank: int, per_node: int) -> None:
    """What the deepspeed launcher exports on a node of ``per_node`` ranks."""
    os.environ["LOCAL_SIZE"] = str(per_node)
    os.environ["LOCAL_RANK"] = str(rank % per_node)


def grad(case: int, rank: int, step: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + 10 * step + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64) * (1.0 + step)


def pipeline_runs(rank: int, world: int, out_dir: str) -> None:
    """The node-aware and the flat pipeline on the same float64 buckets: every step's output and bytes, and the
    residuals at the end (worker and, partitioned, server)."""
    set_layout(rank, 2)
    init_distributed()
    from ds_dragonn.comm.topology import node_groups, resolve_layout
    from ds_dragonn.plan import layout_choice
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress import DragonnCompressor
    from ds_dragonn.exchange import AllgatherExchange, PartitionedExchange
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.hierarchy import NodeAllreduce
    from ds_dragonn.pipeline import CompressedAllreduce

    full = TorchCommBackend()
    layout = resolve_layout("auto", full, layout_choice).layout
    node_group, cross_group = node_groups(layout)
    node, cross = TorchCommBackend(node_group), TorchCommBackend(cross_group)

    def exchange(name, backend, density):
        return (PartitionedExchange(backend, DragonnCompressor(density, min_sample=64)) if name == "partitioned"
                else AllgatherExchange(backend))
    out = {"layout": (layout.nodes, layout.ranks_per_node, layout.node, layout.local_rank), "cases": []}
    for c, (name, numel, density) in enumerate(PIPE_CASES):
        runs = {}
        for kind in ("node", "flat"):
            ef = ErrorFeedback(True)
            if kind == "node":
                inner = CompressedAllreduce(DragonnCompressor(density, min_sample=64), cross, ef,
                                            exchange(name, cross, density))
                pipe = NodeAllreduce(inner, node, full, layout)
            else:
                pipe = CompressedAllreduce(DragonnCompressor(density, min_sample=64), full, ef,
                                           exchange(name, full, density))
            applied, sent, selected = [], [], []
            for step in range(STEPS):
                o, stats = pipe.reduce([grad(c, rank, step, numel)], ("b", c), seed=7 * step, postscale=1.0 / world)
                applied.append(o.clone())
                sent.append(stats.bytes_sent)
                selected.append(stats.numel)  # the elements this rank selected over
                ef.end_step(True)
            server = getattr(pipe.exchange, "server", None)
            runs[kind] = {"applied": applied, "sent": sent, "selected": selected,
                          "residuals": {str(k): v.clone() for k, v in ef.residuals.items()},
                          "server": {str(k): v.clone() for k, v in (server.residuals if server else {}).items()}}
        out["cases"].append(runs)
    torch.save(out, Path(out_dir) / f"hpipe_rank{rank}.pt")
    torch.distributed.destroy_process_group()


_H = {"enabled": True, "density": 0.05, "hierarchy": "node", "warmup_steps": 2}
#: engine runs at 2 nodes x 2 ranks, ZeRO 0, 1 and 2: the gradient and the momentum mode (Adam), density 1.0
#: against the dense engine of the same stage
ENGINE_RUNS = {
    "gradient": zero_config(0, {**_H, "compress": "gradient"}),
    "momentum": {**zero_config(0, {**_H, "compress": "momentum", "advanced": {"variance_refresh_steps": 3}}),
                 "gradient_clipping": 0.0},
    "bf16_partitioned": zero_config(0, {**_H, "compress": "gradient", "exchange": "partitioned"}, bf16=True),
    # the dense warm-up and refreshes quantized across nodes (advanced.dense_values)
    # (named without "dense": test_engines_train_node_aware_in_sync skips the dense baselines by name)
    "momentum_dq_int8": {**zero_config(0, {**_H, "compress": "momentum", "advanced": {
        "variance_refresh_steps": 3, "dense_values": "int8"}}), "gradient_clipping": 0.0},
    # the age bound's block over each node's shard (advanced.max_age)
    "momentum_age": {**zero_config(0, {**_H, "compress": "momentum", "advanced": {
        "variance_refresh_steps": 3, "max_age": 3}}), "gradient_clipping": 0.0},
    "dense_d1": {**zero_config(0, {**_H, "density": 1.0, "compress": "gradient"}), "gradient_clipping": 0.0},
    "dense": {**zero_config(0, None), "gradient_clipping": 0.0},
    # ZeRO 1/2: the node's result, each owner its slices
    "zero2_partitioned": zero_config(2, {**_H, "compress": "gradient", "exchange": "partitioned"}),
    "zero1_momentum": {**zero_config(1, {**_H, "compress": "momentum", "advanced": {"variance_refresh_steps": 3}}),
                       "gradient_clipping": 0.0},
    "zero2_d1": {**zero_config(2, {**_H, "density": 1.0, "compress": "gradient"}), "gradient_clipping": 0.0},
    "zero2_dense": {**zero_config(2, None), "gradient_clipping": 0.0},
}
LAYERS = (32, 64, 10)


def engine_runs(rank: int, world: int, out_dir: str) -> None:
    set_layout(rank, 2)
    init_distributed()
    out = {}
    for name, cfg in ENGINE_RUNS.items():
        engine, hook = train_mlp(cfg, rank, LAYERS, 8)
        out[name] = {"params": [p.detach().float().clone() for p in engine.module.parameters()],
                     "layout": str(getattr(hook, "layout", None)) if hook else None,
                     "telemetry": hook.telemetry.summary() if hook else None}
    torch.save(out, Path(out_dir) / f"hengine_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def fold_runs(rank: int, world: int, out_dir: str) -> None:
    """Node-aware, partitioned: save after 3 steps, load node-aware with allgather (the server residuals fold into
    the worker residuals) and flat (another layout: reset). Each rank's residual sums before and after."""
    set_layout(rank, 2)
    init_distributed()
    ckpt = str(Path(out_dir) / "ckpt")
    cfg = zero_config(0, {**_H, "compress": "gradient", "exchange": "partitioned", "density": 0.02})
    engine, hook = train_mlp(cfg, rank, LAYERS, 3)
    hook.settle()
    worker = {str(k): v.double().clone() for k, v in hook.error_feedback.residuals.items()}
    server = {str(k): v.double().clone() for p in hook.pipelines for k, v in p.exchange.server.residuals.items()}
    before = sum(float(r.sum()) for r in worker.values()) + sum(float(r.sum()) for r in server.values())
    engine.save_checkpoint(ckpt, tag="t")
    out = {"before": before, "worker": worker, "server": server}
    for name, block in (("allgather", {"exchange": "allgather"}), ("flat", {"hierarchy": "flat"})):
        other, ohook = train_mlp(zero_config(0, {**_H, "compress": "gradient", "density": 0.02, **block}), rank,
                                 LAYERS, 0)
        other.load_checkpoint(ckpt, tag="t")
        out[name] = {"after": sum(float(r.double().sum()) for r in ohook.error_feedback.residuals.values()),
                     "residuals": {str(k): v.double().clone() for k, v in ohook.error_feedback.residuals.items()},
                     "notes": list(ohook.notes)}
    torch.save(out, Path(out_dir) / f"hfold_rank{rank}.pt")
    torch.distributed.destroy_process_group()


#: node-aware runs saved at step K and resumed by a fresh engine: ZeRO 2 partitioned, ZeRO 0 momentum
RESUME_RUNS = {
    "zero2_partitioned": zero_config(2, {**_H, "compress": "gradient", "exchange": "partitioned", "density": 0.02}),
    "zero0_momentum": {**zero_config(0, {**_H, "compress": "momentum", "advanced": {"variance_refresh_steps": 3}}),
                       "gradient_clipping": 0.0},
}


def resume_runs(rank: int, world: int, out_dir: str) -> None:
    """Each of RESUME_RUNS: 2K uninterrupted steps saving at K, and a fresh engine that loads K and trains to 2K."""
    from tests.ckpt_cases import K, _engine, _params, _residual_mass, _train
    set_layout(rank, 2)
    init_distributed()
    out = {}
    for name, cfg in RESUME_RUNS.items():
        ckpt = str(Path(out_dir) / "ckpt" / name)
        engine = _engine(cfg)
        _train(engine, rank, 0, K)
        mass = _residual_mass(engine)
        engine.save_checkpoint(ckpt, tag="k")
        _train(engine, rank, K, 2 * K)
        resumed = _engine(cfg)
        resumed.load_checkpoint(ckpt, tag="k")
        loaded_mass = _residual_mass(resumed)
        _train(resumed, rank, K, 2 * K)
        out[name] = {"params": _params(engine), "resumed": _params(resumed), "mass": mass, "loaded_mass": loaded_mass,
                     "notes": list(resumed.dragonn.notes), "layout": str(resumed.dragonn.layout)}
    torch.save(out, Path(out_dir) / f"hresume_rank{rank}.pt")
    torch.distributed.destroy_process_group()
