"""Rank functions for tests/test_equivalence.py (run by ``tests.multiproc.run_ranks``; not collected by pytest).

One launch per world size trains, in sequence, every case of :data:`CASES` three times: with the dense
DeepSpeed engine (no "dragonn" block), with DRAGONN at density 1.0 and at density 0.01 (policy "always",
min_compress_numel 1, so every bucket goes through the compressed path). Each run starts from the same
seeded model and sees the same per-rank sample stream; what a test needs is saved to
``OUT_DIR/equiv_rank<r>.pt``.

Self-contained on purpose (its own config builder and training loop): tests/engines.py is shared with
other tests and may change under them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import PINNED

OPT_STEPS = 4            # optimizer steps per run (micro steps = OPT_STEPS * gradient_accumulation_steps)
LAYERS = (32, 64, 4)     # in -> hidden (tanh) -> classes
MICRO_BATCH = 8

#: case name -> what differs from the plain MLP run
CASES = {
    "gas2": dict(gas=2),
    "gas3": dict(gas=3),
    # the loss is scaled up so that the averaged gradient norm is well above the clip (checked by the test)
    "clip": dict(clip=1.0, loss_scale=30.0),
    # "clip" without clipping (0.0 switches it off: DeepSpeed 0.19.8's default "gradient_clipping" is 1.0, not 0)
    "noclip": dict(clip=0.0, loss_scale=30.0),
    "frozen": dict(model="frozen"),   # a whole hidden layer with requires_grad False (still in the optimizer)
    "empty": dict(model="empty"),     # a Linear with 0 outputs and a Parameter of shape (0,), both in the graph
}
#: the same edge cases through the ZeRO stage 1/2 hook (its own bucket and partition handling; stage 2 also
#: reduces at every micro step of an accumulation, not only at the boundary)
CASES.update({f"z{stage}_{name}": dict(CASES[name], zero=stage)
              for stage in (1, 2) for name in ("gas3", "clip", "frozen", "empty")})
DRAGONN = {"d1": {"enabled": True, "density": 1.0, "min_compress_numel": 1, "policy": "always", **PINNED},
           "d001": {"enabled": True, "density": 0.01, "min_compress_numel": 1, "policy": "always", **PINNED}}
VARIANTS = ("dense", "d1", "d001")


def run_name(case: str, variant: str) -> str:
    return f"{case}/{variant}"


def ds_config(case: dict, variant: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": case.get("gas", 1),
           "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
           "zero_optimization": {"stage": 0}, "steps_per_print": 10**6}
    if case.get("zero"):  # as tests/zero_cases.py's runs: Adam, buckets smaller than the model
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}
        cfg["zero_optimization"] = {"stage": case["zero"], "reduce_bucket_size": 1000}
    if "clip" in case:
        cfg["gradient_clipping"] = case["clip"]
    if variant != "dense":
        cfg["dragonn"] = dict(DRAGONN[variant])
    return cfg


class Net(torch.nn.Module):
    """``LAYERS[0] -> LAYERS[1] (tanh) [-> frozen LAYERS[1] (tanh)] -> LAYERS[2]`` [+ empty parameters]."""

    def __init__(self, kind: str = "plain"):
        super().__init__()
        self.kind = kind
        self.fc1 = torch.nn.Linear(LAYERS[0], LAYERS[1])
        if kind == "frozen":
            self.mid = torch.nn.Linear(LAYERS[1], LAYERS[1])
            self.mid.requires_grad_(False)
        self.fc2 = torch.nn.Linear(LAYERS[1], LAYERS[2])
        if kind == "empty":
            self.none_out = torch.nn.Linear(LAYERS[1], 0)      # weight (0, 64), bias (0,)
            self.empty_vec = torch.nn.Parameter(torch.zeros(0))

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.kind == "frozen":
            h = torch.tanh(self.mid(h))
        out = self.fc2(h)
        if self.kind == "empty":
            # both empty parameters are in the graph, so they get (empty) gradients
            out = torch.cat([out, self.none_out(h)], dim=1) + self.empty_vec.sum()
        return out


def _grad_norm(module: torch.nn.Module) -> float:
    grads = [p.grad.detach().double().reshape(-1) for p in module.parameters() if p.grad is not None]
    return float(torch.cat(grads).norm()) if grads else 0.0


def train(case: dict, variant: str, rank: int) -> dict:
    """One run: the seeded model through ``ds_dragonn.initialize``; returns what the tests compare."""
    import ds_dragonn

    torch.manual_seed(0)
    model = Net(case.get("model", "plain"))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(),
                                       config=ds_config(case, variant))
    gas = case.get("gas", 1)
    scale = case.get("loss_scale", 1.0)
    g = torch.Generator().manual_seed(1000 + rank)
    norms, engine_norms, empty_grads = [], [], []
    for micro in range(OPT_STEPS * gas):
        x = torch.randn(MICRO_BATCH, LAYERS[0], generator=g)
        y = torch.randint(0, LAYERS[2], (MICRO_BATCH,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x), y) * scale
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:
            norms.append(_grad_norm(engine.module))  # the averaged gradient the optimizer (and clip) sees
            if case.get("model") == "empty":
                empty_grads.append([None if p.grad is None else tuple(p.grad.shape)
                                    for p in (model.none_out.weight, model.none_out.bias, model.empty_vec)])
        engine.step()
        if boundary:
            engine_norms.append(engine.get_global_grad_norm())  # ZeRO 1/2: the norm its optimizer clipped with
    hook = getattr(engine, "dragonn", None)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"params": params,
            "initial": initial,
            "frozen": sorted(n for n, p in engine.module.named_parameters() if not p.requires_grad),
            "grad_norms": norms,
            "engine_grad_norms": [None if v is None else float(v) for v in engine_norms],
            "empty_grads": empty_grads,
            "global_steps": int(engine.global_steps),
            "telemetry": hook.telemetry.summary() if hook is not None else None,
            "hooked": hook is not None and (engine.allreduce_bucket == hook.allreduce_bucket if not case.get("zero")
                                            else engine.optimizer.average_tensor == hook.average_tensor)}


def equivalence_runs(rank: int, world: int, out_dir: str) -> None:
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    out = {"world": int(torch.distributed.get_world_size())}
    for case_name, case in CASES.items():
        for variant in VARIANTS:
            out[run_name(case_name, variant)] = train(case, variant, rank)
    torch.save(out, Path(out_dir) / f"equiv_rank{rank}.pt")
    torch.distributed.destroy_process_group()
