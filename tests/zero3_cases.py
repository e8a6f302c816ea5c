"""Multi-rank cases of the ZeRO-3 hook (``ds_dragonn/engine/stage3.py``), for ``tests/test_zero3.py``."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import init_distributed, zero_config

#: (layers, steps) of the MLP: 33 -> 17 -> 5 gives gradients not divisible by 2 or 3 ranks and a bias of 5
LAYERS = (33, 17, 5)
STEPS = 4
_D = {"enabled": True, "density": 0.05, "warmup_steps": 1, "compress": "gradient"}
RUNS = {
    "dense": {**zero_config(3, None), "gradient_clipping": 0.0},
    "d1": {**zero_config(3, {**_D, "density": 1.0}), "gradient_clipping": 0.0},
    "sparse": zero_config(3, _D),
    "sparse_bf16_gas2": zero_config(3, _D, bf16=True, gas=2),
    "sparse_overlap": zero_config(3, _D, overlap_comm=True),
    "sparse_no_overlap": zero_config(3, _D, overlap_comm=False),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.Tanh(),
                               torch.nn.Linear(LAYERS[1], LAYERS[2]))


def _gathered(engine) -> list:
    """The full weights (every rank's partitions gathered), fp32."""
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def train(cfg: dict, rank: int, steps: int = STEPS):
    import ds_dragonn
    model = _model()
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dtype = torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else torch.float32
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps * cfg.get("gradient_accumulation_steps", 1)):
        x = torch.randn(8, LAYERS[0], generator=g).to(dtype)
        y = torch.randint(0, LAYERS[2], (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
    return engine


def runs(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    out = {}
    for name, cfg in RUNS.items():
        engine = train(cfg, rank)
        hook = getattr(engine, "dragonn", None)
        out[name] = {"params": _gathered(engine),
                     "telemetry": hook.telemetry.summary() if hook else None,
                     "residual_mass": (sum(float(v.double().abs().sum()) for v in hook.error_feedback.residuals.values())
                                       if hook else 0.0)}
    torch.save(out, Path(out_dir) / f"z3_rank{rank}.pt")
    torch.distributed.destroy_process_group()


#: saved at step K and resumed by a fresh engine (fp32, density 0.01: residuals carry most of the gradient)
RESUME = zero_config(3, {"enabled": True, "density": 0.01, "warmup_steps": 1, "compress": "gradient"})


def resume_runs(rank: int, world: int, out_dir: str) -> None:
    import tests.ckpt_cases as ckpt_cases
    from tests.ckpt_cases import K, _engine, _residual_mass, _train
    ckpt_cases.LAYERS = LAYERS  # gradients of odd sizes: the rank-major buffer is padded (its length is the key's)
    init_distributed()
    ckpt = str(Path(out_dir) / "ckpt")
    engine = _engine(RESUME)
    _train(engine, rank, 0, K)
    mass = _residual_mass(engine)
    at_k = _gathered(engine)
    engine.save_checkpoint(ckpt, tag="k")
    torch.distributed.barrier()
    # DeepSpeed's offline consolidation (zero_to_fp32) reads the checkpoint beside DRAGONN's files
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    consolidated = [v.float() for v in get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="k").values()]
    _train(engine, rank, K, 2 * K)
    resumed = _engine(RESUME)
    resumed.load_checkpoint(ckpt, tag="k")
    loaded = _residual_mass(resumed)
    _train(resumed, rank, K, 2 * K)
    t = engine.dragonn.telemetry
    out = {"params": _gathered(engine), "resumed": _gathered(resumed), "mass": mass, "loaded_mass": loaded,
           "at_k": at_k, "consolidated": consolidated,
           "notes": list(resumed.dragonn.notes), "bytes": (t.compressed_bytes_sent, t.compressed_dense_bytes)}
    torch.save(out, Path(out_dir) / f"z3resume_rank{rank}.pt")
    torch.distributed.destroy_process_group()


#: ZeRO-3 with hpZ (a secondary parameter partition inside each "node" of 2 ranks), 4 ranks
HPZ_RUNS = {
    "dense": {**zero_config(3, None, zero_hpz_partition_size=2), "gradient_clipping": 0.0},
    "d1": {**zero_config(3, {**_D, "density": 1.0, "hierarchy": "flat"}, zero_hpz_partition_size=2),
           "gradient_clipping": 0.0},
    "sparse": zero_config(3, {**_D, "hierarchy": "flat"}, zero_hpz_partition_size=2),
    # the node-aware exchange (2 nodes of 2: LOCAL_SIZE) with hpZ: dense in the node, a shard across
    "node": zero_config(3, {**_D, "hierarchy": "node", "exchange": "partitioned"}, zero_hpz_partition_size=2),
    "node_d1": {**zero_config(3, {**_D, "density": 1.0, "hierarchy": "node"}, zero_hpz_partition_size=2),
                "gradient_clipping": 0.0},
}


def hpz_runs(rank: int, world: int, out_dir: str) -> None:
    import os
    os.environ["LOCAL_SIZE"], os.environ["LOCAL_RANK"] = "2", str(rank % 2)
    init_distributed()
    out = {}
    for name, cfg in HPZ_RUNS.items():
        engine = train(cfg, rank)
        hook = getattr(engine, "dragonn", None)
        out[name] = {"params": _gathered(engine), "telemetry": hook.telemetry.summary() if hook else None,
                     "layout": str(hook.layout) if hook is not None and hook.layout is not None else "flat"}
    torch.save(out, Path(out_dir) / f"z3hpz_rank{rank}.pt")
    torch.distributed.destroy_process_group()


#: more checks at 2 ranks, one launch: gradient clipping and bf16 with accumulation at density 1.0 against the
#: dense runs (bit for bit), DeepSpeed's own ZeRO-3 checkpoints both ways, bytes on a larger model, and the
#: float64 nothing-lost invariant of the hook itself
CLIP = 0.05  # well under the MLP's gradient norm (about 0.5): every step clips
CLIP_RUNS = {
    "dense_clip": {**zero_config(3, None), "gradient_clipping": CLIP},
    "d1_clip": {**zero_config(3, {**_D, "density": 1.0}), "gradient_clipping": CLIP},
    "dense_bf16_gas2": zero_config(3, None, bf16=True, gas=2),
    "d1_bf16_gas2": zero_config(3, {**_D, "density": 1.0}, bf16=True, gas=2),
}
#: (in, hidden, out) of the model whose gradient bytes are measured: about 36k parameters, 3 buckets
BIG = (128, 256, 10)
#: the nothing-lost buckets: parameter sizes not divisible by 2 ranks, one smaller than the world size
AWKWARD = [(7,), (1,), (3, 5), (1001,)]


def _scatter_float64(cfg: dict, rank: int, seed: int, first_id: int):
    """The hook's ``avg_scatter_grads`` on float64 gradients of :data:`AWKWARD` sizes (fake parameters, 4 steps):
    the hook, and a record of what this rank received per step, its gradients, telemetry and residuals."""
    from types import SimpleNamespace
    engine = train(cfg, rank, steps=0)
    hook, opt = engine.dragonn, engine.optimizer
    opt.gradient_accumulation_dtype = torch.float64  # the fp32 partition's dtype, float64 here
    g = torch.Generator().manual_seed(seed + rank)
    params = [SimpleNamespace(ds_id=first_id + i, ds_shape=s, grad=None) for i, s in enumerate(AWKWARD)]
    grads, received = [], []
    for step in range(4):
        engine.global_steps = 10 + step
        for p in params:
            p.grad = torch.randn(p.ds_shape, generator=g, dtype=torch.float64)
        grads.append([p.grad.clone() for p in params])
        received.append([t.clone() for t in hook.avg_scatter_grads(params, torch.float64)])
    hook.steps.end()
    return hook, {"grads": grads, "received": received, "telemetry": hook.telemetry.summary(),
                  "residuals": {repr(k): v.clone() for k, v in hook.error_feedback.residuals.items()}}


def _nothing_lost(rank: int, world: int) -> dict:
    """:func:`_scatter_float64` at density 0.05 in the gradient mode."""
    return _scatter_float64(zero_config(3, {**_D, "warmup_steps": 0}), rank, 10, 1000)[1]


def more_runs(rank: int, world: int, out_dir: str) -> None:
    import deepspeed
    from tests.ckpt_cases import K
    from tests.engines import train_mlp
    init_distributed()
    out = {}
    for name, cfg in CLIP_RUNS.items():
        engine = train(cfg, rank)
        out[name], out[f"{name}_norm"] = _gathered(engine), float(engine.get_global_grad_norm())
    # bytes: density 0.01, fp32, on a model large enough for the pairs to dominate
    cfg = zero_config(3, {**_D, "density": 0.01, "warmup_steps": 0}, reduce_bucket_size=20000)
    _, hook = train_mlp(cfg, rank, BIG, 3)
    t = hook.telemetry
    out["bytes"] = (t.compressed_bytes_sent, t.compressed_dense_bytes, t.dense_reductions)
    # DeepSpeed's own ZeRO-3 checkpoints: a dense one resumed with DRAGONN (density 1.0: the dense run's
    # steps); DRAGONN's read by zero_to_fp32 and by plain DeepSpeed
    ckpt = str(Path(out_dir) / "ckpt")
    dense = train(RUNS["dense"], rank, steps=K)
    dense.save_checkpoint(ckpt, tag="dense")
    d1 = train(RUNS["d1"], rank, steps=0)
    d1.load_checkpoint(ckpt, tag="dense")
    out["notes"] = list(d1.dragonn.notes)
    for engine in (dense, d1):
        _steps(engine, rank, K)
    out["dense_k2"], out["d1_from_dense_k2"] = _gathered(dense), _gathered(d1)
    d1.save_checkpoint(ckpt, tag="d1")
    torch.distributed.barrier()
    if rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="d1")
        out["fp32"] = [state[n].float() for n, _ in d1.module.named_parameters()]
    plain = train(RUNS["dense"], rank, steps=0)
    plain.load_checkpoint(ckpt, tag="d1")
    out["plain_from_d1"] = _gathered(plain)
    assert not hasattr(plain, "dragonn") and isinstance(plain, deepspeed.DeepSpeedEngine)
    out["lost"] = _nothing_lost(rank, world)
    torch.save(out, Path(out_dir) / f"z3more_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _steps(engine, rank: int, steps: int) -> None:
    """``steps`` more steps on a stream of its own (rank 100 + rank), for engines resumed from a checkpoint."""
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, LAYERS[0], generator=g)
        y = torch.randint(0, LAYERS[2], (8,), generator=g)
        engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        engine.step()


def refused_runs(rank: int, world: int, out_dir: str) -> None:
    """Settings DeepSpeed converts after the config checks ran: "reduce_scatter": "false" (a string) sends
    buckets through a path the hook does not see; refused after initialize, on every rank."""
    import ds_dragonn
    init_distributed()
    cfg = zero_config(3, _D, reduce_scatter="false")
    try:
        train(cfg, rank, 1)
        out = None
    except ds_dragonn.DragonnUnsupportedError as err:
        out = str(err)
    torch.save(out, Path(out_dir) / f"z3refused_rank{rank}.pt")
    torch.distributed.destroy_process_group()


#: the momentum mode (1-bit Adam's structure) at ZeRO-3 and its reference, the same mode at ZeRO-2 on the same
#: model, data and steps; 2 dense steps, then the variance frozen and refreshed every 3 steps (two refreshes)
_M = {"enabled": True, "density": 0.05, "warmup_steps": 2, "compress": "momentum",
      "advanced": {"variance_refresh_steps": 3}}
MOMENTUM_STEPS = 9
SUB_GROUP = 100  # elements per ZeRO-3 sub-group: at 2 ranks the MLP's partitions form two (281, then 9 + 43 + 3)
MOMENTUM_RUNS = {
    "z2_d1": {**zero_config(2, {**_M, "density": 1.0}), "gradient_clipping": 0.0},
    "z3_d1": {**zero_config(3, {**_M, "density": 1.0}), "gradient_clipping": 0.0},
    # several fp32 sub-group flats, each lent to its parameter group for its own step() only
    "z3_d1_subgroups": {**zero_config(3, {**_M, "density": 1.0}, sub_group_size=SUB_GROUP), "gradient_clipping": 0.0},
    "z3_sparse": zero_config(3, _M),
    "z3_sparse_bf16_gas2": zero_config(3, _M, bf16=True, gas=2),
    "z3_auto": zero_config(3, {**_M, "compress": "auto"}),
    "z3_dense": {**zero_config(3, None), "gradient_clipping": 0.0},
}


def _weights(engine) -> list:
    """The full weights, fp32, at any ZeRO stage."""
    if engine.zero_optimization_stage() == 3:
        return _gathered(engine)
    return [p.detach().float().clone() for p in engine.module.parameters()]


def _momentum_lost(rank: int, world: int) -> dict:
    """:func:`_nothing_lost` in the momentum mode (no refresh among the 4 steps): also the local momenta."""
    cfg = zero_config(3, {**_M, "warmup_steps": 1, "advanced": {"variance_refresh_steps": 0}})
    hook, record = _scatter_float64(cfg, rank, 20, 2000)
    return {**record, "beta": hook.momentum.beta,
            "momenta": {repr(k): v.clone() for k, v in hook.momentum.momenta.items()}}


def momentum_runs(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    out = {}
    for name, cfg in MOMENTUM_RUNS.items():
        engine = train(cfg, rank, steps=MOMENTUM_STEPS)
        hook = getattr(engine, "dragonn", None)
        freeze = hook.variance_freeze if hook is not None else None
        out[name] = {"params": _weights(engine), "telemetry": hook.telemetry.summary() if hook else None,
                     "compress": hook.cfg.compress.value if hook else None,
                     "frozen": None if freeze is None or freeze.frozen is None else len(freeze.frozen),
                     "sub_groups": len(getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])),
                     "refreshed": freeze.refreshed if freeze is not None else 0,
                     "residual_mass": (sum(float(v.double().abs().sum()) for v in hook.error_feedback.residuals.values())
                                       if hook else 0.0)}
    out["lost"] = _momentum_lost(rank, world)
    torch.save(out, Path(out_dir) / f"z3mom_rank{rank}.pt")
    torch.distributed.destroy_process_group()


#: the momentum mode saved at step K (after the freeze) and resumed: a refresh every 2 steps falls on both sides
RESUME_MOMENTUM = zero_config(3, {"enabled": True, "density": 0.01, "warmup_steps": 1, "compress": "momentum",
                                  "advanced": {"variance_refresh_steps": 2}}, sub_group_size=SUB_GROUP)


def momentum_resume_runs(rank: int, world: int, out_dir: str) -> None:
    import tests.ckpt_cases as ckpt_cases
    from tests.ckpt_cases import K, _engine, _residual_mass, _train
    ckpt_cases.LAYERS = LAYERS
    init_distributed()
    ckpt = str(Path(out_dir) / "ckpt")
    engine = _engine(RESUME_MOMENTUM)
    _train(engine, rank, 0, K)
    mass = _residual_mass(engine)
    engine.save_checkpoint(ckpt, tag="k")
    frozen_at_k = [v.clone() for v in engine.dragonn.variance_freeze.frozen]
    torch.distributed.barrier()
    _train(engine, rank, K, 2 * K)
    resumed = _engine(RESUME_MOMENTUM)
    resumed.load_checkpoint(ckpt, tag="k")
    loaded, freeze = _residual_mass(resumed), resumed.dragonn.variance_freeze
    frozen = [v.clone() for v in freeze.frozen] if freeze.frozen is not None else None
    _train(resumed, rank, K, 2 * K)
    out = {"params": _gathered(engine), "resumed": _gathered(resumed), "mass": mass, "loaded_mass": loaded,
           "frozen_saved": frozen_at_k, "frozen_loaded": frozen,
           "refreshed": (engine.dragonn.variance_freeze.refreshed, freeze.refreshed),
           "sub_groups": len(resumed.optimizer.fp32_partitioned_groups_flat),
           "notes": list(resumed.dragonn.notes)}
    torch.save(out, Path(out_dir) / f"z3mresume_rank{rank}.pt")
    torch.distributed.destroy_process_group()
