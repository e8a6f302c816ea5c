"""Multi-rank cases of ``tests/test_syncs.py``: the read-backs of one training step per ZeRO stage and exchange.

Each run trains a seeded MLP (bf16, AdamW, one bucket, compressed from the first step) on 2 gloo ranks and
counts, during one step after the first three, the calls from ``ds_dragonn/`` that would read a CUDA device
back (``tests/syncs_harness.py``), with the compressed reductions the step made."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import engine_config, init_distributed, zero_config

LAYERS = (33, 17, 5)
_D = {"enabled": True, "density": 0.05, "min_compress_numel": 1}
_ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}
RUNS = {
    "zero0_allgather": {**engine_config({**_D, "exchange": "allgather"}, bf16=True), "optimizer": _ADAMW},
    "zero0_partitioned": {**engine_config({**_D, "exchange": "partitioned"}, bf16=True), "optimizer": _ADAMW},
    **{f"zero{s}": {**zero_config(s, _D, bf16=True, reduce_bucket_size=10**6), "optimizer": _ADAMW}
       for s in (1, 2, 3)},
    # local momentum compressed, Adam's variance frozen (its per-step checks counted too)
    "zero0_momentum": {**engine_config({**_D, "compress": "momentum", "warmup_steps": 1}, bf16=True), "optimizer": _ADAMW},
    "zero2_momentum": {**zero_config(2, {**_D, "compress": "momentum", "warmup_steps": 1}, bf16=True, reduce_bucket_size=10**6),
                       "optimizer": _ADAMW},
}


def engine_syncs(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    import ds_dragonn
    from tests.syncs_harness import count_syncs
    out = {}
    for name, cfg in RUNS.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.Tanh(),
                                    torch.nn.Linear(LAYERS[1], LAYERS[2]))
        engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        g = torch.Generator().manual_seed(rank)
        counts, before = None, 0
        for step in range(4):
            x = torch.randn(8, LAYERS[0], generator=g).to(torch.bfloat16)
            y = torch.randint(0, LAYERS[2], (8,), generator=g)
            if step == 3:
                before = engine.dragonn.telemetry.compressed_reductions
                with count_syncs() as counts:
                    engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
                    engine.step()
            else:
                engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
                engine.step()
        freeze = getattr(engine.dragonn, "variance_freeze", None)
        out[name] = {"counts": dict(counts), "frozen": bool(freeze is not None and freeze.frozen is not None),
                     "reductions": engine.dragonn.telemetry.compressed_reductions - before}
        engine.destroy() if hasattr(engine, "destroy") else None
    torch.save(out, Path(out_dir) / f"syncs_rank{rank}.pt")
    torch.distributed.destroy_process_group()
