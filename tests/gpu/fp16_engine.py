"""fp16 with dynamic loss scaling through the DRAGONN hook (run by launch/gpu_check.sh on a GPU).

DeepSpeed refuses fp16 engines on CPU, so this runs where a GPU is lent, world size 1 over NCCL:

    python -m deepspeed.launcher.runner --num_gpus 1 tests/gpu/fp16_engine.py [--precision fp16|bf16]

Checks: an overflow step (Inf loss at step BAD) is skipped and leaves every residual exactly as before it;
the residuals follow the loss scale (the guard's units equal the optimizer's scale after every step, which
halves at the overflow and doubles after ``loss_scale_window`` clean steps); training stays finite and
compressed. ``--precision bf16`` runs the same script on CPU (no loss scale), to check the script itself.
Prints one JSON line and exits non-zero on a failed check.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

BAD = 3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    import deepspeed
    import ds_dragonn
    from ds_dragonn.engine.steps import loss_scale

    deepspeed.init_distributed()
    cuda = torch.cuda.is_available()
    cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 0}, "steps_per_print": 10**6,
           "dragonn": {"enabled": True, "density": 0.05, "min_compress_numel": 1, "policy": "always",
                       "warmup_steps": 0, "density_warmup_steps": 0}}
    if args.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 3, "hysteresis": 1}
    else:
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    hook = engine.dragonn
    dtype = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(1)
    failures, scales, snaps = [], [], []
    for step in range(args.steps):
        x = torch.randn(16, 64, generator=g).to(engine.device, dtype)
        y = torch.randint(0, 10, (16,), generator=g).to(engine.device)
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        if step == BAD:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        state = hook.state_dict()
        snaps.append({k: v.detach().cpu().clone() for k, v in state["error_feedback"]["residuals"].items()})
        scales.append(loss_scale(engine))
    if engine.skipped_steps != 1:
        failures.append(f"skipped_steps {engine.skipped_steps}, expected 1")
    if snaps[BAD].keys() != snaps[BAD - 1].keys() or not all(torch.equal(snaps[BAD][k], snaps[BAD - 1][k])
                                                              for k in snaps[BAD]):
        failures.append("a residual changed in the skipped step")
    if not hook.transactional or hook.steps.restored_steps != 1:
        failures.append(f"transactional={hook.transactional} restored={hook.steps.restored_steps}")
    if hook.steps.units != scales[-2] and hook.steps.units != scales[-1]:
        failures.append(f"residual units {hook.steps.units} vs loss scales {scales[-2:]}")
    # halved at the overflow, then doubled after loss_scale_window clean steps (back to where it was: the
    # scales' distinct values can be just two, so look at the moves, not the count of values)
    drop = next((i for i in range(1, len(scales)) if scales[i] < scales[i - 1]), None)
    rise = drop is not None and any(scales[i] > scales[i - 1] for i in range(drop + 1, len(scales)))
    if args.precision == "fp16" and not rise:
        failures.append(f"the loss scale did not both drop and rise: {scales}")
    if not all(bool(torch.isfinite(p).all()) for p in engine.module.parameters()):
        failures.append("non-finite parameters")
    tel = hook.telemetry.summary()
    if tel["compressed_reductions"] < args.steps - 1:
        failures.append(f"only {tel['compressed_reductions']} compressed reductions")
    print(json.dumps({"precision": args.precision, "device": str(engine.device), "loss_scales": scales,
                      "skipped_steps": int(engine.skipped_steps), "restored": hook.steps.restored_steps,
                      "compressed_reductions": tel["compressed_reductions"], "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
