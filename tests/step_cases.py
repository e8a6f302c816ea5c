"""Multi-rank cases for skipped (overflow) steps: run by tests/test_steps.py through tests.multiproc."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import engine_config, init_distributed, zero_config

_EXACT = {"advanced": {"exact_skipped_steps": True}}
SKIP_RUNS = {  # exact: a skipped step leaves no trace
    "s0_bf16_allgather": engine_config({"enabled": True, "density": 0.05, "min_compress_numel": 1, **_EXACT},
                                       bf16=True),
    "s0_bf16_partitioned": engine_config({"enabled": True, "density": 0.05, "min_compress_numel": 1,
                                           "exchange": "partitioned", **_EXACT}, bf16=True),
    "s2_bf16": zero_config(2, {"enabled": True, "density": 0.05, **_EXACT}, bf16=True),
}
LIGHT_RUNS = {  # the default for bf16 and fp32: a skipped step returns what it sent to the residuals (O(k))
    "light_s0_bf16_allgather": engine_config({"enabled": True, "density": 0.05, "min_compress_numel": 1},
                                             bf16=True),
    "light_s0_bf16_partitioned": engine_config({"enabled": True, "density": 0.05, "min_compress_numel": 1,
                                                 "exchange": "partitioned"}, bf16=True),
    "light_s2_bf16_momentum": zero_config(2, {"enabled": True, "density": 0.05, "compress": "momentum",
                                              "warmup_steps": 1}, bf16=True),
    "light_s2_fp32_momentum": zero_config(2, {"enabled": True, "density": 0.05, "compress": "momentum",
                                              "warmup_steps": 1}),
}
SKIP_STEPS, BAD_STEP = 5, 2  # step BAD_STEP (0-based) overflows on rank 0 only


def _residuals(hook) -> dict:
    state = hook.state_dict()  # settles the finished step first
    out = {f"w{k}": v.clone() for k, v in state["error_feedback"]["residuals"].items()}
    for i, ex in enumerate(state["exchange"]):
        for k, v in ex.get("server", {}).get("residuals", {}).items():
            out[f"s{i}{k}"] = v.clone()
    return out


def skip_runs(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    import ds_dragonn

    out = {}
    for name, cfg in {**SKIP_RUNS, **LIGHT_RUNS}.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        g = torch.Generator().manual_seed(rank)
        steps = []
        for step in range(SKIP_STEPS):
            x = torch.randn(8, 32, generator=g).to(next(engine.module.parameters()).dtype)
            y = torch.randint(0, 4, (8,), generator=g)
            loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
            if step == BAD_STEP and rank == 0:
                loss = loss * float("inf")  # Inf/NaN gradients on this rank only
            engine.backward(loss)
            engine.step()
            momenta = engine.dragonn.momentum.momenta if engine.dragonn.momentum is not None else {}
            steps.append({"residuals": _residuals(engine.dragonn), "skipped": int(engine.skipped_steps),
                          "momenta": {k: v.clone() for k, v in momenta.items()},
                          "age_clock": engine.dragonn.age_clock(int(engine.global_steps)),  # the next step's
                          "params": [p.detach().float().clone() for p in engine.module.parameters()]})
        out[name] = {"steps": steps, "transactional": engine.dragonn.transactional,
                     "restored": engine.dragonn.steps.restored_steps}
    torch.save(out, Path(out_dir) / f"skip_rank{rank}.pt")
    torch.distributed.destroy_process_group()
