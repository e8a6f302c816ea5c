"""How far Adam's variance drifts from a variance frozen after the dense warm-up (the momentum mode's).

The momentum mode (``"compress": "momentum"``, 1-bit Adam's structure) applies every step with the
bias-corrected variance ``V̂`` frozen at the end of the dense warm-up (``warmup_steps``; 30 here, the default before ``"auto"``). This
script trains the byte-level GPT of ``launch/train_lm.py`` densely, in one process, with the optimizer and
schedule of ``configs/lm_dense.json`` (AdamW lr 1e-3, weight decay 0.01, clipping 1.0, WarmupDecayLR's log
warm-up over 50 steps and linear decay to 0 at ``--total-steps``; batch = micro-batch × accumulation × ranks of
that config at 2 ranks), and records, per parameter tensor, the median over its elements of
``sqrt(V̂_t) / sqrt(V̂_freeze)``: how much larger (>1) or smaller (<1) dense Adam's step denominator is at
step t than the frozen one. A frozen-variance step is ``ratio`` times the dense Adam step.

With ``--refresh-steps R`` (default 100, the ``variance_refresh_steps`` default) it also follows the momentum
mode's refreshed variance on the same dense trajectory: every R steps after the freeze
``V̂ ← ρ·V̂ + (1 − ρ)·g²`` from that step's clipped gradient (``ρ = max(β2^R, 0.9)`` unless ``--refresh-decay``;
floored at ``--floor`` of each tensor's mean ``sqrt(V̂)``, as ``engine/adam.py`` does), and records the same
per-tensor ratio against it: how far each scheme's denominator is from dense Adam's.

    python launch/variance_drift.py                       # ~4 min on 2 cores: steps 30..600 of a 2000-step schedule
    python launch/variance_drift.py --steps 200 --at 30,100,200 --json /tmp/v.json --plot /tmp/v.png

Prints a table; writes JSON (per tensor and step) and a PNG (the spread of the per-tensor ratios by step).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import pyplot, save_figure, write_json  # noqa: E402
from train_lm import CTX, D_MODEL, N_HEAD, N_LAYER, SEED, ByteGPT, stdlib_corpus, windows  # noqa: E402

from ds_dragonn.engine.variance_math import VARIANCE_FLOOR, default_refresh_decay, floor_variance_  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """DeepSpeed's WarmupDecayLR (log warm-up, then linear decay to 0 at ``total``) at 0-based ``step``."""
    if step < warmup:
        return peak * math.log(step + 1) / math.log(warmup)
    return peak * max(0.0, (total - step) / max(1, total - warmup))


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="optimizer steps to run (default 600)")
    p.add_argument("--total-steps", type=int, default=2000, help="the schedule's length (decay to 0 there)")
    p.add_argument("--freeze-step", type=int, default=30, help="the step the momentum mode freezes at (warmup_steps)")
    p.add_argument("--at", default="30,60,100,200,300,400,600", help="steps to record (comma-separated)")
    p.add_argument("--refresh-steps", type=int, default=100, help="variance refresh interval (0: none)")
    p.add_argument("--refresh-decay", type=float, default=None, help="rho of a refresh (default max(beta2^R, 0.9))")
    p.add_argument("--floor", type=float, default=VARIANCE_FLOOR, help="floor of the frozen/refreshed variance (variance_math.VARIANCE_FLOOR)")
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks the batch stands for")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--json", default=str(REPO / "runs" / "variance_drift.json"))
    p.add_argument("--plot", default=str(REPO / "runs" / "variance_drift.png"))
    a = p.parse_args(argv)
    a.at = sorted({int(s) for s in a.at.split(",") if s.strip()} | {a.freeze_step})
    if a.freeze_step < 1 or a.steps < a.freeze_step:
        p.error(f"--freeze-step must be in [1, --steps]; got {a.freeze_step} with --steps {a.steps}")
    return a


def main(argv=None) -> int:
    args = get_args(argv)
    cfg = json.loads((REPO / "configs" / "lm_dense.json").read_text())
    opt_cfg, sched = cfg["optimizer"]["params"], cfg["scheduler"]["params"]
    batch = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * args.ranks
    torch.manual_seed(args.seed)
    train, _ = stdlib_corpus()
    model = ByteGPT(N_LAYER, D_MODEL, N_HEAD, CTX)
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg["lr"], weight_decay=opt_cfg.get("weight_decay", 0.01))
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(args.seed)
    frozen, refreshed, rows, t0 = None, None, [], time.time()
    beta2 = opt.param_groups[0]["betas"][1]
    rho = args.refresh_decay if args.refresh_decay is not None else default_refresh_decay(beta2, args.refresh_steps)
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, sched["warmup_max_lr"], sched["warmup_num_steps"], args.total_steps)
        x, y = windows(train, torch.randint(0, len(train) - CTX - 1, (batch,), generator=gen), CTX)
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.get("gradient_clipping", 1.0))
        # the momentum mode's refresh steps: 0-based steps freeze + R - 1, + 2R - 1, ... (schedule.refresh)
        r = args.refresh_steps
        if refreshed is not None and r and (step - 1 - args.freeze_step) % r == r - 1:
            refreshed = [floor_variance_(rho * v + (1 - rho) * p.grad.detach() ** 2, args.floor)
                         for v, p in zip(refreshed, model.parameters())]
        opt.step()
        if step == args.freeze_step:
            refreshed = [floor_variance_(opt.state[p]["exp_avg_sq"] / (1 - beta2 ** float(opt.state[p]["step"])),
                                         args.floor) for p in model.parameters()]
        if step not in args.at:
            continue
        root = [(opt.state[p]["exp_avg_sq"] / (1 - beta2 ** float(opt.state[p]["step"]))).sqrt()
                for p in model.parameters()]
        if step == args.freeze_step:
            frozen = [r.clone() for r in root]
        if frozen is None:
            continue
        row = {"step": step, "loss": float(loss.detach())}
        for tag, ref in (("", frozen), ("refreshed_", [v.sqrt() for v in refreshed])):
            # elements with no variance at the freeze (bytes never seen yet) have no ratio: left out of both
            ratios = {n: float((x / f)[z > 0].median()) if bool((z > 0).any()) else float("nan")
                      for n, x, f, z in zip(names, root, ref, frozen)}
            finite = [v for v in ratios.values() if math.isfinite(v)]
            row.update({f"{tag}per_tensor": ratios, f"{tag}min": min(finite), f"{tag}max": max(finite),
                        f"{tag}median": statistics.median(finite),
                        f"{tag}outside_2x": sum(1 for v in finite if v > 2 or v < 0.5) / len(finite)})
        rows.append(row)
        print(f"step {step:5d} | loss {float(loss):.3f} | per-tensor median sqrt(V)/sqrt(V_{args.freeze_step}): "
              f"min {row['min']:.2f} median {row['median']:.2f} max {row['max']:.2f}, off >2x {100 * row['outside_2x']:.0f} % | "
              f"refreshed every {r}: min {row['refreshed_min']:.2f} max {row['refreshed_max']:.2f}, off >2x "
              f"{100 * row['refreshed_outside_2x']:.0f} % | {time.time() - t0:.0f} s", flush=True)
    write_json(Path(args.json), {"freeze_step": args.freeze_step, "total_steps": args.total_steps, "batch": batch,
                                 "refresh_steps": args.refresh_steps, "refresh_decay": rho, "floor": args.floor,
                                 "params": sum(p.numel() for p in model.parameters()), "rows": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    steps = [r["step"] for r in rows]
    for n in names:
        ax.plot(steps, [r["per_tensor"][n] for r in rows], color="grey", lw=0.6, alpha=0.6)
    ax.plot(steps, [r["median"] for r in rows], color="black", lw=2, label="median over tensors (frozen)")
    ax.fill_between(steps, [r["refreshed_min"] for r in rows], [r["refreshed_max"] for r in rows], color="tab:blue",
                    alpha=0.25, label=f"refreshed every {args.refresh_steps} steps: min-max over tensors")
    ax.axhline(1.0, color="tab:red", lw=1, ls="--", label="frozen")
    ax.set(yscale="log", xlabel="optimizer step", ylabel=f"sqrt(V̂_t) / sqrt(V̂_{args.freeze_step}) (per-tensor median)",
           title=f"Adam's variance drift after a freeze at step {args.freeze_step} (byte GPT, dense)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, Path(args.plot), dpi=110)
    print(f"wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
