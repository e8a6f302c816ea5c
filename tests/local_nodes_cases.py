"""Rank function for tests/test_local_nodes.py: ``sync: local_steps`` with ``hierarchy: node`` at 2 nodes x 2 ranks
(``LOCAL_SIZE=2``), every case in one launch of 4 processes."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import init_distributed
from tests.hierarchy_cases import set_layout
from tests.local_steps_cases import COLLECTIVES, build, config, micro_batches, record_rounds, weights

L = 2
_NODE = {"hierarchy": "node"}
#: name -> (dragonn block, config kwargs, optimizer steps): warm-up 2, rounds of 3 (syncs at steps 5 and 8)
RUNS = {
    # without error feedback every node restarts from θ_outer (nothing unsent is kept): all ranks alike after a sync
    "fp32_clip": ({**_NODE, "density": 0.1, "advanced": {"error_feedback": False}}, {"clip": 1.0}, 8),
    "bf16_gas2_clip": ({**_NODE, "density": 0.1}, {"bf16": True, "gas": 2, "clip": 1.0}, 8),
    "dense_delta": ({**_NODE, "density": 1.0, "outer_lr": 0.7}, {}, 8),
    # the unsent Δ kept in the node's weights (density < 1 with error feedback): the node's shards gathered
    "kept_fp32": ({**_NODE, "density": 0.1}, {"clip": 1.0}, 8),
}
#: runs whose nodes keep their unsent Δ in their weights (after a sync the nodes differ)
KEPT = tuple(name for name, (block, _, _) in RUNS.items()
             if block.get("advanced", {}).get("error_feedback", True) and block["density"] < 1)


def count_spans() -> tuple:
    """Wrap torch.distributed's collectives with a counter of those whose group lies inside one node (``node``)
    and those that span nodes (``cross``; the world group included); returns ``(counts, restore)``."""
    import torch.distributed as tdist
    from deepspeed.comm import comm as dscomm
    counts = {"node": 0, "cross": 0}

    def span(args, kwargs) -> str:
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, tdist.ProcessGroup)), None)
        ranks = tdist.get_process_group_ranks(group) if group is not None else range(tdist.get_world_size())
        return "cross" if len({r // L for r in ranks}) > 1 else "node"

    def wrap(fn):
        def counted(*args, **kwargs):
            counts[span(args, kwargs)] += 1
            return fn(*args, **kwargs)
        return counted
    originals = {n: getattr(tdist, n) for n in COLLECTIVES if getattr(tdist, n, None) is not None}
    bound = {n: getattr(dscomm.cdb, n) for n in ("all_gather_function", "reduce_scatter_function")
             if getattr(dscomm.cdb, n, None) is not None}
    for n, f in originals.items():
        setattr(tdist, n, wrap(f))
    for n, f in bound.items():
        setattr(dscomm.cdb, n, wrap(f))

    def restore():
        for n, f in originals.items():
            setattr(tdist, n, f)
        for n, f in bound.items():
            setattr(dscomm.cdb, n, f)
    return counts, restore


def _rounds(rank: int) -> dict:
    """RUNS: every optimizer step's weights and collectives (node / cross), the rounds' pseudo-gradients and
    averages, the shard residuals, telemetry."""
    out = {}
    for name, (dragonn, kwargs, steps) in RUNS.items():
        engine = build(config(dragonn, **kwargs))
        hook = engine.dragonn
        log = record_rounds(engine)
        log["outer"] = _record_outer(hook)
        gas = engine.gradient_accumulation_steps()
        counts, restore = count_spans()
        per_step, before = [], dict(counts)
        for i, (x, y) in enumerate(micro_batches(rank, steps * gas, next(engine.module.parameters()).dtype)):
            engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
            engine.step()
            if (i + 1) % gas == 0:
                per_step.append({"weights": weights(engine), "rounds": hook.outer.rounds,
                                 **{k: counts[k] - before[k] for k in counts}})
                before = dict(counts)
        restore()
        out[name] = {**log, "per_step": per_step, "layout": str(hook.layout),
                     "anchor": torch.cat([a.flatten().double() for a in hook.outer.anchor]),
                     "residuals": [r.double().clone() for r in hook.error_feedback.residuals.values()],
                     "telemetry": hook.telemetry.summary(), "steps": int(engine.global_steps),
                     "outer_lr": hook.outer.lr, "workers": hook.workers,
                     "numel": sum(p.numel() for p in engine.module.parameters()),
                     "itemsize": engine.communication_data_type.itemsize}
    return out


def _record_outer(hook) -> list:
    """Around every outer step, in float64: θ_outer and this rank's master weights before it, θ_outer after."""
    log, sync = [], hook.sync

    def flat(tensors):
        return torch.cat([t.detach().flatten().double() for t in tensors])

    def recorded(steps):
        before = {"anchor": flat(hook.outer.anchor), "masters": flat(hook.masters())}
        sync(steps)
        log.append({**before, "after": flat(hook.outer.anchor)})
    hook.sync = recorded
    return log


def _sgd(rank: int) -> dict:
    """Plain SGD, density 1.0, one local step per round, outer lr 1, node-aware; and the dense engine."""
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    out = {}
    node = {**_NODE, "density": 1.0, "local_steps": 1, "warmup_steps": 0, "outer_lr": 1.0}
    for name, dragonn in (("dense", None), ("node", node)):
        engine = build(config(dragonn, optimizer=sgd))
        for x, y in micro_batches(rank, 6, torch.float32):
            engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
            engine.step()
        out[name] = weights(engine)
    return out


def _train(engine, batches) -> None:
    for x, y in batches:
        engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        engine.step()


def _resume(rank: int, out_dir: str) -> dict:
    """Save mid-round at step 7 (syncs at 5 and 8), resume on the same layout (exact at step 12) and flat
    (another layout: every rank restarts from θ_outer, then step 8 syncs)."""
    ckpt = str(Path(out_dir) / "ckpt")
    cfg = config({**_NODE, "outer_lr": 0.7, "density": 0.05})
    engine = build(cfg)
    batches = micro_batches(rank, 12, torch.float32)
    _train(engine, batches[:7])
    engine.save_checkpoint(ckpt, tag="mid")
    saved = {"anchor": [a.clone() for a in engine.dragonn.outer.anchor], "rounds": engine.dragonn.outer.rounds,
             "weights": weights(engine)}
    _train(engine, batches[7:])
    fresh = build(cfg)
    fresh.load_checkpoint(ckpt, tag="mid")
    notes = list(fresh.dragonn.notes)
    _train(fresh, batches[7:])
    flat = build(config({"outer_lr": 0.7, "density": 0.05, "hierarchy": "flat"}))
    flat.load_checkpoint(ckpt, tag="mid")
    loaded = {"weights": weights(flat), "rounds": flat.dragonn.outer.rounds, "notes": list(flat.dragonn.notes),
              "layout": flat.dragonn.layout}
    _train(flat, batches[7:8])
    # θ_outer after the sync (the weights keep each rank's residual)
    loaded["after"], loaded["rounds_after"] = [a.clone() for a in flat.dragonn.outer.anchor], flat.dragonn.outer.rounds
    return {"saved": saved, "straight": weights(engine), "resumed": weights(fresh), "notes": notes,
            "anchor": [a.clone() for a in engine.dragonn.outer.anchor],
            "anchor_resumed": [a.clone() for a in fresh.dragonn.outer.anchor], "flat": loaded}


def node_rounds(rank: int, world: int, out_dir: str) -> None:
    set_layout(rank, L)
    init_distributed()
    out = {"rounds": _rounds(rank), "sgd": _sgd(rank), "resume": _resume(rank, out_dir)}
    torch.save(out, Path(out_dir) / f"lnodes_rank{rank}.pt")
    torch.distributed.destroy_process_group()
