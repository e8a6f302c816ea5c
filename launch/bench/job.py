"""What the main-job training scripts (``train.py``, ``train_lm.py``) share: their common arguments, the
traffic totals of a dense run, and the end of a run (the summary on rank 0, leaving the process group)."""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import torch

from ds_dragonn.exchange.wire import dense_allreduce_bytes


def job_parser(description: str, steps: int, log_interval: int, seed: int) -> argparse.ArgumentParser:
    """A parser with the arguments every main-job script takes: ``--steps``, ``--log-interval``, ``--seed``,
    ``--summary`` and the deepspeed launcher's ``--local_rank``. The script adds its own, then
    ``deepspeed.add_config_arguments``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--log-interval", type=int, default=log_interval)
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--summary", type=str, default=None, help="write a JSON summary here (rank 0)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p.add_argument("--hier-dense", choices=("bf16", "fp32"), default=None,
                   help="benchmark baseline: a dense allreduce node by node, across nodes in this dtype "
                        "(launch/bench/hier_dense.py; dense ZeRO-0 configs only)")
    return p


def install_baselines(engine, args) -> Optional[str]:
    """The benchmark baselines a job's arguments ask for (``--hier-dense``); returns the node layout in
    words, or None when no baseline is installed."""
    if not getattr(args, "hier_dense", None):
        return None
    from bench.hier_dense import install
    return install(engine, torch.bfloat16 if args.hier_dense == "bf16" else torch.float32)


def dense_totals(model: torch.nn.Module, world: int, steps: int) -> dict:
    """Bytes a ring allreduce of every gradient sends per rank over ``steps`` reductions (a dense run has no
    telemetry): ``bytes_sent`` = ``dense_bytes_equivalent``, and no compression time."""
    numel_by_itemsize: dict = {}
    for p in model.parameters():
        numel_by_itemsize[p.element_size()] = numel_by_itemsize.get(p.element_size(), 0) + p.numel()
    ring = steps * sum(dense_allreduce_bytes(n, size, world) for size, n in numel_by_itemsize.items())
    return {"bytes_sent": ring, "dense_bytes_equivalent": ring, "compress_ms_mean": 0.0}


def report(summary: dict, rank: int, line: str, path: Optional[str]) -> None:
    """Rank 0 prints ``line`` followed by the run's traffic and writes ``summary`` to ``path`` (if given)."""
    if rank != 0:
        return
    print(f"{line} | bytes_sent {summary['bytes_sent']} | dense_bytes_equivalent "
          f"{summary['dense_bytes_equivalent']}", flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # e.g. runs/lm/ in a fresh clone
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)


def finish(summary: dict, dragonn, model: torch.nn.Module, world: int, rank: int, line: str,
           path: Optional[str]) -> None:
    """The end of a run on every rank: ``summary`` gets the traffic totals (the DRAGONN telemetry's, or
    :func:`dense_totals` when ``dragonn`` is None), rank 0 reports it (:func:`report`), then the ranks meet
    and leave the process group."""
    import deepspeed.comm as dist

    summary.update(dragonn.telemetry.summary() if dragonn else dense_totals(model, world, summary["steps"]))
    layout = getattr(dragonn, "layout", None)  # (a --hier-dense baseline has set its own)
    summary.setdefault("hierarchy", str(layout) if layout is not None else "flat")
    if dragonn:  # as resolved for the engine ("auto": from its learning-rate warm-up)
        warm = dragonn.schedule.warmup_steps
        summary["dragonn_warmup_steps"] = min(warm, summary["steps"])  # (never ended: the whole run)
        # ("auto": as resolved; the part of it inside the run: none where the dense warm-up never ended)
        summary["dragonn_density_warmup_steps"] = max(0, min(dragonn.schedule.steps, summary["steps"] - warm))
    report(summary, rank, line, path)
    dist.barrier()
    torch.distributed.destroy_process_group()
