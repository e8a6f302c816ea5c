"""Multi-rank cases for DRAGONN state in DeepSpeed checkpoints: run by tests/test_checkpoint.py."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import engine_config, init_distributed, zero_config

K = 3  # save after K steps; compare at 2K
_D = {"enabled": True, "density": 0.01, "min_compress_numel": 1}
RESUME_RUNS = {
    "s0_fp32": engine_config(_D),
    "s0_partitioned": engine_config({**_D, "exchange": "partitioned"}),
    "s0_bf16": engine_config(_D, bf16=True),  # bf16 steps may be skipped
    "s2_fp32": zero_config(2, {"enabled": True, "density": 0.01}),
    "s0_bf16_partitioned": engine_config({**_D, "exchange": "partitioned"}, bf16=True),
    "s0_dense": engine_config(None),  # a checkpoint without DRAGONN state
    # the momentum mode: the local momentum and the frozen variance are in the state too; the bf16 run refreshes
    # the variance at steps 2 and 4 (one before the save at K = 3, one after the load)
    "s0_bf16_momentum": zero_config(0, {"enabled": True, "density": 0.01, "compress": "momentum", "warmup_steps": 1,
                                        "advanced": {"variance_refresh_steps": 2}}, bf16=True),
    # ... at ZeRO 2, with a learning rate that changes every step
    "s2_fp32_momentum": {**zero_config(2, {"enabled": True, "density": 0.01, "compress": "momentum", "warmup_steps": 1}),
                         "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                           "warmup_num_steps": 3, "total_num_steps": 12}}},
    # quantized values (advanced.values): the rounding in the worker and the owners' residuals resumes exactly
    "s0_bf16_int8_partitioned": engine_config({**_D, "exchange": "partitioned", "advanced": {"values": "int8"}},
                                              bf16=True),
    "s2_fp32_int4": zero_config(2, {"enabled": True, "density": 0.01, "advanced": {"values": "int4"}}),
}
#: a second engine of these runs trains past K, then loads the step-K tag in the same process and trains to 2K:
#: the result must be the uninterrupted run's. (steps past K, overflow step or -1): s0_fp32 stops one step
#: past K, so its last reduction round has the loaded step's number (bucket ordinals must restart); the bf16
#: run overflows at K and stops after a clean step, so a transaction opened with one skipped step counted
#: is still open when DeepSpeed restores skipped_steps to 0 (it must be dropped, not undone into the load)
RELOAD_IN_PROCESS = {"s0_fp32": (1, -1), "s0_bf16_partitioned": (2, K)}
LAYERS = (32, 64, 4)


def _engine(cfg: dict, frozen_first: bool = False):
    import ds_dragonn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.Tanh(),
                                torch.nn.Linear(LAYERS[1], LAYERS[2]))
    if frozen_first:
        model[0].weight.requires_grad_(False)
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _train(engine, rank: int, start: int, stop: int, overflow_at: int = -1) -> None:
    dtype = next(engine.module.parameters()).dtype
    for step in range(start, stop):  # each step's batch depends on (rank, step) only: resumable
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(8, LAYERS[0], generator=g).to(dtype)
        y = torch.randint(0, LAYERS[2], (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        if step == overflow_at and rank == 0:
            loss = loss * float("inf")  # bf16/fp16 engines skip this step
        engine.backward(loss)
        engine.step()


def _params(engine) -> list:
    return [p.detach().float().clone() for p in engine.module.parameters()]


def _residual_mass(engine) -> float:
    hook = getattr(engine, "dragonn", None)
    if hook is None:
        return 0.0
    residuals = hook.state_dict()["error_feedback"]["residuals"]  # settled: the last step's residuals
    return float(sum(float(v.double().abs().sum()) for v in residuals.values()))


def save_runs(rank: int, world: int, out_dir: str) -> None:
    """Uninterrupted runs of 2K steps, each saving a checkpoint at step K."""
    init_distributed()
    out = {}
    for name, cfg in RESUME_RUNS.items():
        engine = _engine(cfg)
        _train(engine, rank, 0, K)
        mass = _residual_mass(engine)
        engine.save_checkpoint(str(Path(out_dir) / "ckpt" / name), tag="k")
        _train(engine, rank, K, 2 * K)
        if name == "s0_fp32":
            engine.save_checkpoint(str(Path(out_dir) / "ckpt" / name), tag="end")  # a second tag, step 2K
            engine.save_checkpoint(str(Path(out_dir) / "ckpt" / name), tag="end2")  # another tag, same step
        out[name] = {"params": _params(engine), "mass_at_k": mass}
    for name, (past, overflow_at) in RELOAD_IN_PROCESS.items():
        engine = _engine(RESUME_RUNS[name])
        _train(engine, rank, 0, K + past, overflow_at=overflow_at)
        engine.load_checkpoint(str(Path(out_dir) / "ckpt" / name), tag="k")
        _train(engine, rank, K, 2 * K)
        out[name]["reloaded_params"] = _params(engine)
        out[name]["restored_steps"] = engine.dragonn.steps.restored_steps  # real skipped steps only
    torch.save(out, Path(out_dir) / f"save_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def resume_runs(rank: int, world: int, out_dir: str) -> None:
    """Fresh processes: load each step-K checkpoint and train to 2K; then the mismatch cases."""
    init_distributed()
    ckpt = Path(out_dir) / "ckpt"
    out = {}

    def resume(name: str, cfg: dict, source: str, frozen_first: bool = False, **load) -> dict:
        engine = _engine(cfg, frozen_first)
        path, _ = engine.load_checkpoint(str(ckpt / source), tag="k", **load)
        hook = getattr(engine, "dragonn", None)
        got = {"loaded": path is not None, "mass_after_load": _residual_mass(engine),
               "notes": list(hook.notes) if hook else [], "global_steps": int(engine.global_steps)}
        _train(engine, rank, K, 2 * K)
        got["params"] = _params(engine)
        return got

    for name, cfg in RESUME_RUNS.items():
        out[name] = resume(name, cfg, name)
    # documented rules, each with its warning
    out["density_changed"] = resume("density_changed", engine_config({**_D, "density": 0.001}), "s0_fp32")
    out["exchange_changed"] = resume("exchange_changed", engine_config(_D), "s0_partitioned")
    out["model_changed"] = resume("model_changed", engine_config(_D), "s0_fp32", frozen_first=True)
    out["warm_start"] = resume("warm_start", engine_config(_D), "s0_fp32", load_optimizer_states=False)
    out["no_dragonn_state"] = resume("no_dragonn_state", engine_config(_D), "s0_dense")
    # a flush owed by a resumed residual (density 0.4 bf16 under auto: pairs cost more than dense, so the
    # bucket goes dense and flushes) on a step that overflows: still owed afterwards, sent the step after
    for name, extra in (("flush_on_skipped_step", {"advanced": {"exact_skipped_steps": True}}),
                        ("flush_on_skipped_step_ok", {})):
        engine = _engine(engine_config({**_D, "density": 0.4, "policy": "auto", **extra}, bf16=True))
        engine.load_checkpoint(str(ckpt / "s0_bf16"), tag="k")
        flush = {"after_load": _residual_mass(engine)}
        _train(engine, rank, K, K + 1, overflow_at=K)
        flush["after_skipped"] = _residual_mass(engine)
        flush["pending_after_skipped"] = len(engine.dragonn.pending)
        _train(engine, rank, K + 1, K + 2)
        flush["after_next"] = _residual_mass(engine)
        flush["skipped"] = int(engine.skipped_steps)
        out[name] = flush
    # DeepSpeed's averaging changed: the residuals are in other units
    out["predivide_changed"] = resume("predivide_changed", engine_config(_D, predivide=2.0), "s0_fp32")
    # ranks resuming different tags (at different steps, at the same step): an error on every rank, not a
    # hang in the next step
    import ds_dragonn

    def mismatch(tag: str):
        try:
            _engine(engine_config(_D)).load_checkpoint(str(ckpt / "s0_fp32"), tag=tag)
            return None
        except ds_dragonn.CheckpointMismatchError as err:
            return str(err)

    out["different_tags"] = mismatch("k" if rank == 0 else "end")
    out["same_step_other_tag"] = mismatch("end" if rank == 0 else "end2")
    torch.save(out, Path(out_dir) / f"resume_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def resized_runs(rank: int, world: int, out_dir: str) -> None:
    """A 2-rank checkpoint loaded by 3 ranks: residuals reset on every rank, training goes on in step."""
    init_distributed()
    engine = _engine(RESUME_RUNS["s0_fp32"])
    path, _ = engine.load_checkpoint(str(Path(out_dir) / "ckpt" / "s0_fp32"), tag="k")
    notes, mass = list(engine.dragonn.notes), _residual_mass(engine)
    _train(engine, rank, K, K + 2)
    torch.save({"loaded": path is not None, "notes": notes, "mass_after_load": mass, "params": _params(engine)},
               Path(out_dir) / f"resized_rank{rank}.pt")
    torch.distributed.destroy_process_group()
