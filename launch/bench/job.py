"""What the main-job scripts (``train.py``, ``train_lm.py``) share at the end of a run: the traffic totals of
a dense run and writing the summary on rank 0."""
from __future__ import annotations

import json
from typing import Optional

import torch


def dense_totals(model: torch.nn.Module, world: int, steps: int) -> dict:
    """Bytes a ring allreduce of every gradient sends per rank over ``steps`` reductions (a dense run has no
    telemetry): ``bytes_sent`` = ``dense_bytes_equivalent``, and no compression time."""
    ring = 2 * (world - 1) / world * sum(p.numel() * p.element_size() for p in model.parameters())
    return {"bytes_sent": int(ring * steps), "dense_bytes_equivalent": int(ring * steps), "compress_ms_mean": 0.0}


def report(summary: dict, rank: int, line: str, path: Optional[str]) -> None:
    """Rank 0 prints ``line`` followed by the run's traffic and writes ``summary`` to ``path`` (if given)."""
    if rank != 0:
        return
    print(f"{line} | bytes_sent {summary['bytes_sent']} | dense_bytes_equivalent "
          f"{summary['dense_bytes_equivalent']}", flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
