"""Device syncs of one compressed reduction per exchange, on the GPU (``launch/gpu_check.sh``).

Counts the syncs torch reports with ``torch.cuda.set_sync_debug_mode("warn")`` (one warning per synchronising
call) during the third reduction of one bucket, for every exchange, over ranks that mirror this one
(``tests/syncs_harness.py``). Writes one JSON record. ``--dry-run``: on CPU, counted with the harness's
instrumented calls instead (what ``tests/test_syncs.py`` asserts).

    python tests/gpu/sync_count.py --out OUT.json [--numel 67108864] [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import warnings

import torch

from ds_dragonn.compress import DragonnCompressor
from ds_dragonn.exchange import AllgatherExchange, PartitionedExchange
from ds_dragonn.exchange.reduce_scatter import RangeOwnership, ReduceScatterExchange
from ds_dragonn.feedback import ErrorFeedback
from ds_dragonn.pipeline import CompressedAllreduce
from tests.syncs_harness import count_syncs, mirrored


def one(name: str, n: int, device: torch.device, dry: bool) -> dict:
    with mirrored(2) as backend:
        ex = {"allgather": lambda: AllgatherExchange(backend),
              "partitioned": lambda: PartitionedExchange(backend, DragonnCompressor(0.01)),
              "reduce_scatter": lambda: ReduceScatterExchange(backend)}[name]()
        own = RangeOwnership(n, [(0, n // 2, 0), (n // 2, n - n // 2, 1)], 2) if name == "reduce_scatter" else None
        pipe = CompressedAllreduce(DragonnCompressor(0.01), backend, ErrorFeedback(True), ex)
        for step in range(3):
            x = torch.randn(n, device=device)
            if step < 2:
                pipe.reduce(x, "b", step, ownership=own)
            elif dry:
                with count_syncs() as c:
                    pipe.reduce(x, "b", step, ownership=own)
                return {"exchange": name, "numel": n, "syncs": sum(c.values()), "where": dict(c)}
            else:
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        pipe.reduce(x, "b", step, ownership=own)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                where = [str(w.message).splitlines()[0][:200] for w in caught if "synchroniz" in str(w.message)]
                return {"exchange": name, "numel": n, "syncs": len(where), "where": where}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--dry-run", action="store_true", help="CPU, small, instrumented calls instead of CUDA's")
    a = ap.parse_args(argv)
    dry = a.dry_run or not torch.cuda.is_available()
    n = min(a.numel, 1 << 16) if dry else a.numel
    device = torch.device("cpu" if dry else "cuda")
    recs = [one(name, n, device, dry) for name in ("allgather", "partitioned", "reduce_scatter")]
    with open(a.out, "w") as f:
        json.dump({"device": str(device), "dry_run": dry, "records": recs}, f, indent=1)
    for r in recs:
        print(r["exchange"], r["syncs"])


if __name__ == "__main__":
    main()
