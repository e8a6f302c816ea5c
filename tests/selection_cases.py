"""Global selection and the density schedule in real engines (2 gloo ranks; run by tests/test_selection.py).

The model has one parameter whose gradients are 1000x smaller than the others' (``quiet``, a 64x64 matrix
scaled by 1e-3 in the forward pass) and a 1-D bias (``bias``): a single global threshold over the bucket never
reaches them in a few steps (they wait in the residual).
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import engine_config, init_distributed, zero_config

STEPS = 6


class Quiet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.loud = torch.nn.Linear(64, 256, bias=False)      # 16384 elements, ordinary gradients
        self.quiet = torch.nn.Parameter(torch.randn(64, 64) * 0.1)  # 4096 elements, gradients x 1e-3
        self.bias = torch.nn.Parameter(torch.zeros(256))       # 1-D, gradients x 1e-3
        self.head = torch.nn.Linear(256, 4, bias=False)

    def forward(self, x):
        h = self.loud(x) + 1e-3 * self.bias
        h = h + 1e-3 * (x @ self.quiet).repeat(1, 4)
        return self.head(torch.tanh(h))


_D = {"enabled": True, "density": 0.01, "min_compress_numel": 1}
RUNS = {
    # the product's defaults: 30 dense warm-up steps, then the density warm-up (from 0.25 over 100 steps)
    "defaults": engine_config(dict(_D)),  # dragonn block replaced below
    "density_warmup": engine_config(dict(_D)),  # dragonn block replaced below
    "global": engine_config({**_D, "density_warmup_steps": 0}),
    # one IPG bucket for the whole model (DeepSpeed's default size), as ZeRO-0 flattens it
    "zero2_global": zero_config(2, {**_D, "density_warmup_steps": 0}, reduce_bucket_size=500_000_000),
}
RUNS["defaults"]["dragonn"] = {"policy": "always", **_D}  # without the suite's pinned settings
RUNS["density_warmup"]["dragonn"] = {"policy": "always", **_D, "warmup_steps": 2}
RUNS["zero2_global"]["optimizer"]["params"]["weight_decay"] = 0.0  # DeepSpeed's "Adam" is AdamW: only updates move


def selection_runs(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    import ds_dragonn

    out = {}
    for name, cfg in RUNS.items():
        torch.manual_seed(0)
        model = Quiet()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        g = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            x = torch.randn(8, 64, generator=g)
            y = torch.randint(0, 4, (8,), generator=g)
            loss = torch.nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
        hook = engine.dragonn
        out[name] = {"moved": {n: int((p.detach() != init[n]).sum()) for n, p in engine.module.named_parameters()},
                     "numel": {n: p.numel() for n, p in engine.module.named_parameters()},
                     "telemetry": hook.telemetry.summary(), "density": hook.compressor.density,
                     "params": [p.detach().clone() for p in engine.module.parameters()]}
    torch.save(out, Path(out_dir) / f"selection_rank{rank}.pt")
    torch.distributed.destroy_process_group()
