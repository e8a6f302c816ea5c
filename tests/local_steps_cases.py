"""Rank functions for tests/test_local_steps.py (``sync: local_steps``), run by ``tests.multiproc.run_ranks``."""
from __future__ import annotations

from pathlib import Path

import torch

from ds_dragonn.exchange.ownership import HashedOwnership
from tests.engines import init_distributed

LAYERS = (32, 64, 10)  # 2762 parameters: not divisible by 4 ranks, k = 28 at density 0.01


def config(dragonn: dict | None, bf16: bool = False, gas: int = 1, optimizer: dict | None = None,
           clip: float = 0.0, schedule: bool = False, stage: int = 0) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": gas,
           "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "gradient_clipping": clip, "steps_per_print": 10**6}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if schedule:
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                "warmup_num_steps": 3, "total_num_steps": 40}}
    if dragonn is not None:
        cfg["dragonn"] = {"enabled": True, "sync": "local_steps", "warmup_steps": 2, "local_steps": 3,
                          "density": 0.1, **dragonn}
    return cfg


def build(cfg: dict):
    import ds_dragonn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.Tanh(),
                                torch.nn.Linear(LAYERS[1], LAYERS[2]))
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def micro_batches(rank: int, count: int, dtype: torch.dtype):
    """The rank's own stream of ``count`` micro batches (8 samples each)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(8, LAYERS[0], generator=g).to(dtype), torch.randint(0, LAYERS[2], (8,), generator=g))
            for _ in range(count)]


def train(engine, batches, on_step=None) -> None:
    for i, (x, y) in enumerate(batches):
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        if on_step is not None and engine.is_gradient_accumulation_boundary() is False and \
                (i + 1) % engine.gradient_accumulation_steps() == 0:
            on_step(engine)


def weights(engine) -> list:
    return [p.detach().float().clone() for p in engine.module.parameters()]


def record_rounds(engine) -> dict:
    """Capture every round's pseudo-gradient (this rank's) and the averaged one applied (float64 copies)."""
    hook, log = engine.dragonn, {"delta": [], "applied": [], "anchor0": None, "weights": [], "anchors": [],
                                 "masters": [], "kept": []}
    pseudo, apply_, sync = hook.outer.pseudo_gradient, hook.outer.apply_, hook.sync

    def pseudo_gradient(masters):
        if log["anchor0"] is None:
            log["anchor0"] = torch.cat([a.flatten().double() for a in hook.outer.anchor])
        out = pseudo(masters)
        log["delta"].append(torch.cat([d.flatten().double() for d in out]))
        return out

    def apply(averaged):
        log["applied"].append(torch.cat([d.flatten().double() for d in averaged]))
        return apply_(averaged)

    def synced(steps):
        sync(steps)
        log["weights"].append(weights(engine))
        log["anchors"].append(torch.cat([a.flatten() for a in hook.outer.anchor]))
        log["masters"].append(torch.cat([m.detach().flatten().clone() for m in hook.masters()]))
        residual = next(iter(hook.error_feedback.residuals.values()), None)
        log["kept"].append(None if residual is None else residual.clone())

    hook.outer.pseudo_gradient, hook.outer.apply_, hook.sync = pseudo_gradient, apply, synced
    return log


#: name -> (dragonn block, config kwargs, optimizer steps)
RUNS = {
    "allgather_fp32": ({}, {}, 11),
    # below density 1.0 each rank keeps its unsent Δ in its weights (error reset, CSER)
    "partitioned_fp32": ({"exchange": "partitioned"}, {}, 11),
    "bf16_gas2_clip_sched": ({"density": 0.01}, {"bf16": True, "gas": 2, "clip": 1.0, "schedule": True}, 11),
    "outer_lr": ({"outer_lr": 0.7}, {}, 11),
    # without error feedback nothing unsent is kept: every rank restarts from θ_outer, the weights bit-identical
    "no_feedback": ({"advanced": {"error_feedback": False}}, {}, 8),
    "dense_delta": ({"density": 1.0}, {"bf16": True}, 8),
    "no_warmup_h1": ({"warmup_steps": 0, "local_steps": 1}, {}, 4),
    # quantized values (advanced.values): the Δ's rounding stays in the residual (the owners' too)
    "int8_fp32": ({"advanced": {"values": "int8"}}, {}, 11),
    "partitioned_int4_fp32": ({"exchange": "partitioned", "advanced": {"values": "int4"}}, {}, 11),
    "kept_bf16_gas2": ({"density": 0.05}, {"bf16": True, "gas": 2, "clip": 1.0, "schedule": True}, 11),
}
#: runs whose ranks keep their own unsent Δ in their weights: θ_outer is shared, the weights are not
KEPT = tuple(name for name, (block, _, _) in RUNS.items()
             if block.get("advanced", {}).get("error_feedback", True) and block.get("density", 0.1) < 1)


def rounds(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    out = {}
    for name, (dragonn, kwargs, steps) in RUNS.items():
        engine = build(config(dragonn, **kwargs))
        log = record_rounds(engine)
        gas = engine.gradient_accumulation_steps()
        train(engine, micro_batches(rank, steps * gas, next(engine.module.parameters()).dtype))
        hook = engine.dragonn
        residuals = [r.double().clone() for r in hook.error_feedback.residuals.values()]
        server = torch.zeros(sum(p.numel() for p in engine.module.parameters()), dtype=torch.float64)
        for pipe in hook.pipelines:  # the partitioned exchange's owner residuals, at their global indices
            for part in (getattr(getattr(pipe.exchange, "server", None), "residuals", None) or {}).values():
                own = HashedOwnership(server.numel(), world)
                server.index_add_(0, own.to_index(rank, torch.arange(part.numel())), part.double())
        out[name] = {**log, "final": weights(engine), "anchor": [a.clone() for a in hook.outer.anchor],
                     "residual": residuals[0] if residuals else None,
                     "server": server,
                     "telemetry": hook.telemetry.summary(), "steps": int(engine.global_steps),
                     "outer_lr": hook.outer.lr,
                     "numel": sum(p.numel() for p in engine.module.parameters()),
                     "itemsize": engine.communication_data_type.itemsize}
    torch.save(out, Path(out_dir) / f"rounds_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def sgd_equivalence(rank: int, world: int, out_dir: str) -> None:
    """Plain SGD, density 1.0, one local step per round, outer lr 1: the dense engine's trajectory."""
    init_distributed()
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    out = {}
    local = {"density": 1.0, "local_steps": 1, "warmup_steps": 0, "outer_lr": 1.0}
    for name, dragonn in (("dense", None), ("local", local)):
        engine = build(config(dragonn, optimizer=sgd))
        train(engine, micro_batches(rank, 6, torch.float32))
        out[name] = weights(engine)
    torch.save(out, Path(out_dir) / f"sgd_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def resume(rank: int, world: int, out_dir: str) -> None:
    """Save mid-round (step 7: rounds end at 5 and 8), resume in a fresh engine: bit-exact at step 12."""
    init_distributed()
    ckpt = str(Path(out_dir) / "ckpt")
    out = {}
    no_feedback = {"advanced": {"error_feedback": False}}
    for name, kwargs, extra in (("fp32", {}, {}), ("bf16_gas2", {"bf16": True, "gas": 2, "clip": 1.0, "schedule": True}, {}),
                                ("no_feedback_fp32", {}, no_feedback)):
        dragonn = {"outer_lr": 0.7, "density": 0.05, **extra}
        cfg = config(dragonn, **kwargs)
        engine = build(cfg)
        gas = engine.gradient_accumulation_steps()
        batches = micro_batches(rank, 12 * gas, next(engine.module.parameters()).dtype)
        train(engine, batches[:7 * gas])
        engine.save_checkpoint(ckpt + "/" + name, tag="mid")
        train(engine, batches[7 * gas:])
        straight = weights(engine)
        fresh = build(cfg)
        fresh.load_checkpoint(ckpt + "/" + name, tag="mid")
        train(fresh, batches[7 * gas:])
        out[name] = {"straight": straight, "resumed": weights(fresh),
                     "anchor": [a.clone() for a in engine.dragonn.outer.anchor],
                     "anchor_resumed": [a.clone() for a in fresh.dragonn.outer.anchor]}
    torch.save(out, Path(out_dir) / f"resume_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def refusals(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    import ds_dragonn
    out = {}
    for name, cfg in (("zero1", config({}, stage=1)), ("zero2", config({}, stage=2))):
        try:
            build(cfg)
            out[name] = None
        except ds_dragonn.DragonnUnsupportedError as err:
            out[name] = str(err)
    torch.save(out, Path(out_dir) / f"refusals_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def warm_starts(rank: int, world: int, out_dir: str) -> None:
    """The rounds start from rank 0's weights as they are at the first local step: after a load without the
    optimizer states (bf16: DeepSpeed leaves each rank's fp32 masters as they were), and after weights set by
    hand after ``initialize`` (warm-up 0)."""
    init_distributed()
    ckpt = str(Path(out_dir) / "ckpt")
    out = {}
    cfg = config({"density": 0.05}, bf16=True)
    engine = build(cfg)
    batches = micro_batches(rank, 20, torch.bfloat16)
    train(engine, batches[:7])
    engine.save_checkpoint(ckpt, tag="mid")
    other = build(cfg)
    log = record_rounds(other)
    train(other, batches[10:13])  # 3 local steps of its own first
    other.load_checkpoint(ckpt, tag="mid", load_optimizer_states=False)
    log["weights"].clear()
    log["anchors"].clear()
    train(other, batches[13:20])
    out["no_optimizer_states"] = [[a] for a in log["anchors"]]  # θ_outer (the weights keep each rank's residual)
    # weights set by hand after initialize, no warm-up: the first round starts from them
    engine = build(config({"warmup_steps": 0, "local_steps": 2, "density": 0.1}))
    init = weights(engine)
    with torch.no_grad():
        for p in engine.module.parameters():
            p.fill_(0.5)
    train(engine, micro_batches(rank, 2, torch.float32))
    out["by_hand"] = {"init": init, "after": weights(engine)}
    # saved mid-round (step 7), resumed with a longer dense warm-up (10): the dense steps start from one state
    longer = build(config({"density": 0.05, "warmup_steps": 10}, bf16=True))
    longer.load_checkpoint(ckpt, tag="mid")
    train(longer, batches[7:10])
    out["longer_warmup"] = weights(longer)
    torch.save(out, Path(out_dir) / f"warm_rank{rank}.pt")
    torch.distributed.destroy_process_group()


#: the collectives a rank can issue through deepspeed.comm / torch.distributed (counted by :func:`count_collectives`)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_to_all_single", "all_gather_object", "barrier", "reduce", "gather", "all_reduce_coalesced")


def count_collectives() -> tuple:
    """Wrap torch.distributed's collectives (deepspeed.comm calls them at call time) with a counter; returns
    ``(counts, restore)``."""
    import torch.distributed as tdist
    counts, originals = {"n": 0}, {}
    for name in COLLECTIVES:
        fn = getattr(tdist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def counted(*args, _fn=fn, **kwargs):
            counts["n"] += 1
            return _fn(*args, **kwargs)
        setattr(tdist, name, counted)
    from deepspeed.comm import comm as dscomm  # deepspeed.comm binds these two at init
    bound = {n: getattr(dscomm.cdb, n) for n in ("all_gather_function", "reduce_scatter_function")
             if getattr(dscomm.cdb, n, None) is not None}
    for name, fn in bound.items():
        def counted_bound(*args, _fn=fn, **kwargs):
            counts["n"] += 1
            return _fn(*args, **kwargs)
        setattr(dscomm.cdb, name, counted_bound)

    def restore():
        for n, f in originals.items():
            setattr(tdist, n, f)
        for n, f in bound.items():
            setattr(dscomm.cdb, n, f)
    return counts, restore


def collectives_per_step(rank: int, world: int, out_dir: str) -> None:
    """Collectives issued in each optimizer step (warm-up 2, rounds of 3: steps 3-4 local, 5 a sync), with
    DeepSpeed's default clipping (1.0) in fp32 and bf16."""
    init_distributed()
    out = {}
    for name, kwargs in (("fp32_clip", {"clip": 1.0}), ("bf16_clip", {"bf16": True, "clip": 1.0})):
        engine = build(config({"advanced": {"error_feedback": False}}, **kwargs))  # bit-identical weights
        counts, restore = count_collectives()
        per_step = []
        for x, y in micro_batches(rank, 8, next(engine.module.parameters()).dtype):
            before = counts["n"]
            loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            per_step.append(counts["n"] - before)
        restore()
        out[name] = {"per_step": per_step, "weights": weights(engine)}
    torch.save(out, Path(out_dir) / f"collectives_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def save_mid_round(rank: int, world: int, out_dir: str) -> None:
    """Train 7 steps (warm-up 2, rounds end at 5 and 8) and save at step 7, mid-round; record θ_outer."""
    init_distributed()
    engine = build(config({"density": 0.1}))
    train(engine, micro_batches(rank, 7, torch.float32))
    engine.save_checkpoint(str(Path(out_dir) / "ckpt"), tag="mid")
    torch.save({"anchor": [a.clone() for a in engine.dragonn.outer.anchor], "weights": weights(engine),
                "rounds": engine.dragonn.outer.rounds}, Path(out_dir) / f"saved_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def load_other_world(rank: int, world: int, out_dir: str) -> None:
    """Load the 2-rank mid-round checkpoint at this world size, then train to step 8 (a sync)."""
    init_distributed()
    engine = build(config({"density": 0.1}))
    engine.load_checkpoint(str(Path(out_dir) / "ckpt"), tag="mid")
    hook = engine.dragonn
    out = {"loaded": weights(engine), "rounds": hook.outer.rounds, "notes": list(hook.notes)}
    train(engine, micro_batches(100 + rank, 1, torch.float32))
    out["after"] = [a.clone() for a in hook.outer.anchor]  # θ_outer (the weights keep each rank's residual)
    out["rounds_after"] = hook.outer.rounds
    torch.save(out, Path(out_dir) / f"world{world}_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def switch_residual(rank: int, world: int, out_dir: str) -> None:
    """Saved mid-round (step 7) with the unsent Δ in the weights, resumed at density 1.0: the dense round at step 8
    flushes the residual once, so θ_outer becomes the mean of the ranks' weights (outer lr 1) and nothing stays
    behind."""
    init_distributed()
    ckpt = str(Path(out_dir) / "ckpt")
    engine = build(config({"density": 0.1}))
    batches = micro_batches(rank, 8, torch.float32)
    train(engine, batches[:7])
    engine.save_checkpoint(ckpt, tag="mid")
    out = {}
    dense = build(config({"density": 1.0, "outer_lr": 1.0}))  # lr 1: θ_outer becomes the ranks' mean
    dense.load_checkpoint(ckpt, tag="mid")
    hook, sync = dense.dragonn, dense.dragonn.sync
    seen = {}

    def recorded(steps):
        seen["before"] = torch.cat([m.detach().flatten().double() for m in hook.masters()])
        seen["anchor_before"] = torch.cat([a.flatten().double() for a in hook.outer.anchor])
        sync(steps)
    hook.sync = recorded
    train(dense, batches[7:8])
    out["dense"] = {**seen, "notes": list(hook.notes),
                    "anchor": torch.cat([a.flatten().double() for a in hook.outer.anchor]),
                    "residual": torch.cat([r.double().flatten() for r in hook.error_feedback.residuals.values()])}
    torch.save(out, Path(out_dir) / f"switch_rank{rank}.pt")
    torch.distributed.destroy_process_group()
