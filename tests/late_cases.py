"""Multi-rank cases of parameters that first get gradient after the dense warm-up (momentum mode), for
``tests/test_late_params.py``; executed inside each rank by ``tests.multiproc.run_ranks``.

The model: an MLP trunk and a side ``Linear(64, 10)`` whose output is multiplied by 0 for the first
``LATE_AT`` steps, then by ``scale`` (1 or 1000): the side layer's gradient is exactly 0 through the dense
warm-up. Also an embedding whose upper rows are first looked up after the warm-up. Each run records, per
step, the largest element step ``max |Δθ| / lr`` of the late tensors, and the held-out loss.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import init_distributed

LR = 1e-3
WARMUP = 10
LATE_AT = 10
DIM, HIDDEN, CLASSES = 64, 256, 10


class SideModel(torch.nn.Module):
    """An MLP trunk (64 -> 256 -> 10) plus a side ``Linear(64, 10)`` gated by ``self.gate``."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))
        self.side = torch.nn.Linear(DIM, CLASSES)
        self.register_buffer("gate", torch.zeros(()))

    def forward(self, x):
        return self.trunk(x) + self.gate * self.side(x)


class EmbedModel(torch.nn.Module):
    """Bag-of-tokens classifier: an embedding of 512 rows (rows >= 256 appear only after ``LATE_AT``)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(512, DIM)
        self.head = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(dim=1))


def _config(dragonn, stage: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    if dragonn is not None:
        cfg["dragonn"] = {"enabled": True, "density": 0.01, "warmup_steps": WARMUP, "min_compress_numel": 0,
                          "density_warmup_steps": 0, "policy": "always", **dragonn}
    return cfg


def _batch(kind: str, g: torch.Generator, step: int):
    if kind == "side":
        x = torch.randn(16, DIM, generator=g)
        return x, (x[:, :CLASSES] * 3).argmax(dim=1)
    hi = 512 if step >= LATE_AT else 256
    tokens = torch.randint(0, hi, (16, 8), generator=g)
    return tokens, tokens[:, 0] % CLASSES


def _full(engine, params) -> list:
    """Copies of ``params``' full values (gathered at ZeRO-3, where each rank holds a partition)."""
    if engine.zero_optimization_stage() != 3:
        return [p.detach().clone() for p in params]
    import deepspeed
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def run(kind: str, dragonn, stage: int, scale: float, steps: int, rank: int) -> dict:
    """One training run; returns the per-step largest late-tensor step in learning rates and the final
    held-out loss (the same 256 samples on every rank)."""
    import ds_dragonn
    torch.manual_seed(0)
    model = SideModel() if kind == "side" else EmbedModel()
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=_config(dragonn, stage))
    module = engine.module
    late = [module.side.weight, module.side.bias] if kind == "side" else [module.embed.weight]
    g = torch.Generator().manual_seed(rank)
    held = torch.Generator().manual_seed(999)
    held_x, held_y = _batch(kind, held, steps)
    if kind == "side":
        held_x, held_y = torch.randn(256, DIM, generator=held), None
        held_y = (held_x[:, :CLASSES] * 3).argmax(dim=1)
    others = [p for p in module.parameters() if all(p is not q for q in late)]
    moves, others_moves, rows_moves, losses = [], [], [], []
    for step in range(steps):
        if kind == "side":
            module.gate.fill_(scale if step >= LATE_AT else 0.0)
        x, y = _batch(kind, g, step)
        before, before_o = _full(engine, late), _full(engine, others)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        after, after_o = _full(engine, late), _full(engine, others)
        moves.append(max(float((p - b).abs().max()) for p, b in zip(after, before)) / LR)
        others_moves.append(max(float((p - b).abs().max()) for p, b in zip(after_o, before_o)) / LR)
        if kind == "embed":  # the rows first looked up after the warm-up
            rows_moves.append(float((after[0][256:] - before[0][256:]).abs().max()) / LR)
        with torch.no_grad():
            losses.append(float(torch.nn.functional.cross_entropy(engine(held_x), held_y)))
    return {"moves": moves, "others": others_moves, "late_rows": rows_moves, "losses": losses}


#: (name, kind, dragonn block or None for dense, ZeRO stage, scale, steps)
CASES = [
    ("side_x1000_refresh", "side", {}, 0, 1000.0, 230),
    ("side_x1000_norefresh", "side", {"advanced": {"variance_refresh_steps": 0}}, 0, 1000.0, 230),
    ("side_x1_norefresh", "side", {"advanced": {"variance_refresh_steps": 0}}, 0, 1.0, 230),
    ("side_x1_refresh", "side", {}, 0, 1.0, 230),
    ("side_x1000_dense", "side", None, 0, 1000.0, 230),
    ("side_x1_dense", "side", None, 0, 1.0, 230),
    ("embed_s0", "embed", {}, 0, 1.0, 230),
    ("embed_s2", "embed", {}, 2, 1.0, 230),
    ("embed_s3", "embed", {}, 3, 1.0, 230),  # the variance frozen on ZeRO-3's fp32 sub-group flats
    ("embed_dense", "embed", None, 0, 1.0, 230),
]


def cases(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    import os
    only = os.environ.get("LATE_CASES")
    out = {}
    for name, kind, dragonn, stage, scale, steps in CASES:
        if only and name not in only.split(","):
            continue
        out[name] = run(kind, dragonn, stage, scale, steps, rank)
    torch.save(out, Path(out_dir) / f"late_rank{rank}.pt")
    torch.distributed.destroy_process_group()
