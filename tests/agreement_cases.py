"""Multi-rank cases of ranks that disagree on the "dragonn" block, for ``tests/test_agreement.py``; executed
inside each rank by ``tests.multiproc.run_ranks``."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import engine_config, init_distributed

DISAGREE = {  # name -> per-rank "dragonn" blocks (rank r takes entry r % 2)
    "enabled": [{"enabled": True, "density": 0.01}, {"enabled": False, "density": 0.01}],
    "min_compress_numel": [{"enabled": True, "min_compress_numel": 1}, {"enabled": True, "min_compress_numel": 10**9}],
    "warmup_steps": [{"enabled": True, "warmup_steps": 0}, {"enabled": True, "warmup_steps": 3}],
    "zero_stage": [{"enabled": True}, {"enabled": True}],  # stage 0 on rank 0, stage 2 on the others
    "gradient_accumulation_steps": [{"enabled": True}, {"enabled": True}],  # 1 on rank 0, 2 on the others
    # a nested key is named by its dotted path, not as the whole "advanced" object
    "advanced.max_age": [{"enabled": True, "advanced": {"max_age": 0}}, {"enabled": True, "advanced": {"max_age": 50}}],
}
REFUSED_ON_ONE_RANK = {  # rank 0 fine, the others refuse: every rank must stop at once, none may hang
    "invalid_key": [{"enabled": True}, {"enabled": True, "densty": 0.1}],
    "offload": [{"enabled": True}, {"enabled": True}],  # offload_optimizer on ranks >= 1
}
AGREE_ANYWAY = {  # differences that change no collective: no error
    "log_interval": [{"enabled": True, "min_compress_numel": 1, "log_interval": 0},
                     {"enabled": True, "min_compress_numel": 1, "log_interval": 5}],
    "all_disabled": [{"enabled": False, "density": 0.5}, None],
}


def disagree_runs(rank: int, world: int, out_dir: str) -> None:
    """Each case: every rank must raise at initialize (a hang fails by timeout), or none for AGREE_ANYWAY."""
    init_distributed()
    import time
    import ds_dragonn

    out = {}
    cases = {**DISAGREE, **REFUSED_ON_ONE_RANK, **AGREE_ANYWAY}
    for name, blocks in cases.items():
        block = blocks[min(rank, 1)]
        cfg = engine_config(block) if block is not None else engine_config(None)
        if block is not None and "densty" in block:
            cfg["dragonn"] = dict(block)
        if name == "gradient_accumulation_steps" and rank > 0:
            cfg["gradient_accumulation_steps"] = 2
        if (name == "zero_stage" or name == "offload") and rank > 0:
            cfg["zero_optimization"] = {"stage": 2}
            cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}
            if name == "offload":
                cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        model = torch.nn.Linear(8, 4)
        t0 = time.monotonic()
        try:
            ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            out[name] = (None, None, time.monotonic() - t0)
        except (ds_dragonn.DragonnConfigError, ds_dragonn.DragonnUnsupportedError) as err:
            out[name] = (type(err).__name__, str(err), time.monotonic() - t0)
    # and ranks that agree still train (the check is one collective at initialize)
    model = torch.nn.Linear(8, 4)
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(),
                                       config=engine_config({"enabled": True, "min_compress_numel": 1}))
    engine.backward(engine(torch.randn(8, 8)).sum())
    engine.step()
    out["agree_compressed"] = engine.dragonn.telemetry.compressed_reductions
    # ranks that froze different layers of the same size: same bucket length, other parameters
    from ds_dragonn.exchange import BufferMismatchError
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(10, 10, bias=False), "b": torch.nn.Linear(10, 10, bias=False)})
    model["b" if rank == 0 else "a"].weight.requires_grad_(False)
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(),
                                       config=engine_config({"enabled": True, "min_compress_numel": 1}))
    try:
        engine.backward((engine.module["a"](torch.ones(2, 10)) + engine.module["b"](torch.ones(2, 10))).sum())
        engine.step()
        out["layout_mismatch"] = None
    except BufferMismatchError as err:
        out["layout_mismatch"] = str(err)
    torch.save(out, Path(out_dir) / f"disagree_rank{rank}.pt")
    torch.distributed.destroy_process_group()
