"""What a user pays per compressed bucket on one GPU (``launch/gpu_check.sh``), as JSON records.

Three parts, each written to ``OUTDIR/<part>.json``:

- ``step_cost``: the whole compressed step of one fp32 bucket at density 0.01 (compensate, select, commit,
  decode; no wire: one rank) against one read pass (``g.sum()``), medians of CUDA-event times;
- ``syncs``: the device syncs of one compressed reduction per exchange (2 mirrored ranks, in-process), from
  ``torch.profiler`` (``cudaDeviceSynchronize``, ``cudaStreamSynchronize``, device-to-host ``Memcpy``) and
  ``torch.cuda.set_sync_debug_mode("warn")``;
- ``memory``: ``torch.cuda.max_memory_allocated`` of a few training steps, dense against DRAGONN, at world
  size 1 for ZeRO 0-3.

``--dry-run`` runs every part on CPU at small sizes (no timings or memory of any meaning): the check that the
script works, for machines without a GPU.

    python tests/gpu/user_cost.py --outdir DIR [--dry-run] [--sizes 20 22 24 26] [--memory-hidden 4096]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import warnings
from pathlib import Path

DRY = "--dry-run" in sys.argv
os.environ.setdefault("DS_ACCELERATOR", "cpu" if DRY else "cuda")

import torch  # noqa: E402

from ds_dragonn.compress import DragonnCompressor  # noqa: E402
from ds_dragonn.exchange import AllgatherExchange, PartitionedExchange  # noqa: E402
from ds_dragonn.exchange.reduce_scatter import RangeOwnership, ReduceScatterExchange  # noqa: E402
from ds_dragonn.feedback import ErrorFeedback  # noqa: E402
from ds_dragonn.pipeline import CompressedAllreduce  # noqa: E402
from tests.syncs_harness import count_syncs, mirrored  # noqa: E402

DENSITY = 0.01
SYNC_EVENTS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _pipeline(name: str, backend, n: int):
    ex = {"allgather": lambda: AllgatherExchange(backend),
          "partitioned": lambda: PartitionedExchange(backend, DragonnCompressor(DENSITY)),
          "reduce_scatter": lambda: ReduceScatterExchange(backend)}[name]()
    w = backend.world_size
    own = (RangeOwnership(n, [(r * (n // w), n // w if r < w - 1 else n - (w - 1) * (n // w), r) for r in range(w)], w)
           if name == "reduce_scatter" else None)
    return CompressedAllreduce(DragonnCompressor(DENSITY), backend, ErrorFeedback(True), ex), own


def step_cost(device, sizes, repeat: int) -> list:
    """The compressed step of one bucket against one read pass, per size (one rank: no wire)."""
    recs = []
    for e in sizes:
        n = 1 << e
        g = torch.randn(n, device=device) * torch.rand(n, device=device).pow(3)
        with mirrored(1) as backend:
            pipe, _ = _pipeline("allgather", backend, n)
            seed = [0]

            def step():
                seed[0] += 1
                pipe.reduce(g, "b", seed[0])
            for _ in range(3):
                step()
            _sync(device)
            step_ms = _median_ms(step, device, repeat)
            read_ms = _median_ms(g.sum, device, repeat)
            sel_ms = _median_ms(lambda: pipe.compressor.compress(g, 7), device, repeat)
        recs.append({"log2_numel": e, "step_ms": step_ms, "select_ms": sel_ms, "read_ms": read_ms,
                     "step_over_read": step_ms / read_ms if read_ms else None,
                     "select_over_read": sel_ms / read_ms if read_ms else None})
        print(json.dumps(recs[-1]), flush=True)
    return recs


def syncs(device, n: int) -> list:
    """Device syncs of the third reduction of one bucket, per exchange (2 mirrored ranks)."""
    recs = []
    for name in ("allgather", "partitioned", "reduce_scatter"):
        with mirrored(2) as backend:
            pipe, own = _pipeline(name, backend, n)
            for s in range(2):
                pipe.reduce(torch.randn(n, device=device), "b", s, ownership=own)
            x = torch.randn(n, device=device)
            _sync(device)
            rec = {"exchange": name, "log2_numel": n.bit_length() - 1}
            if device.type != "cuda":
                with count_syncs() as c:
                    pipe.reduce(x, "b", 2, ownership=own)
                rec.update(instrumented=sum(c.values()), where=dict(c))
            else:
                from torch.profiler import ProfilerActivity, profile
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                            pipe.reduce(x, "b", 2, ownership=own)
                            torch.cuda.synchronize()  # closes the window: one counted below, subtracted
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                names = [ev.name for ev in prof.events()]
                rec["profiler_syncs"] = sum(1 for nm in names if nm in SYNC_EVENTS) - 1
                rec["memcpy_dtoh"] = sum(1 for nm in names if "Memcpy DtoH" in nm or "DtoH" in nm)
                rec["debug_mode_warnings"] = len([w for w in caught if "synchroniz" in str(w.message).lower()])
                rec["warnings"] = sorted({str(w.message).splitlines()[0][:160] for w in caught})[:10]
        recs.append(rec)
        print(json.dumps(rec), flush=True)
    return recs


def memory(device, hidden: int, steps: int) -> list:
    """Peak memory of ``steps`` training steps of a 2-layer MLP (hidden × hidden), dense against DRAGONN, at
    world size 1 for ZeRO 0-3 (an in-process process group: NCCL on a GPU, gloo on CPU)."""
    import deepspeed
    import ds_dragonn
    os.environ.update({k: v for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                                          "MASTER_ADDR": "127.0.0.1"}.items() if k not in os.environ})
    os.environ.setdefault("MASTER_PORT", "29571")
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    recs = []
    for stage in (0, 1, 2, 3):
        for mode in ("dense", "dragonn"):
            cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**6,
                   "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                   "zero_optimization": {"stage": stage}}
            if mode == "dragonn":
                cfg["dragonn"] = {"enabled": True, "density": DENSITY, "policy": "always", "warmup_steps": 0,
                                  "density_warmup_steps": 0, "compress": "gradient", "min_compress_numel": 1}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden))
            rec = {"zero": stage, "mode": mode, "params": sum(p.numel() for p in model.parameters())}
            try:
                engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
                for _ in range(steps):
                    x = torch.randn(8, hidden, device=engine.device)
                    engine.backward(engine(x).float().pow(2).mean())
                    engine.step()
                t = getattr(getattr(engine, "dragonn", None), "telemetry", None)
                rec["compressed_reductions"] = t.compressed_reductions if t is not None else 0
                rec["max_memory_allocated"] = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
                engine.destroy() if hasattr(engine, "destroy") else None
                del engine
            except Exception as err:  # noqa: BLE001 - one failed row must not hide the others
                rec["error"] = f"{type(err).__name__}: {err}"[:500]
            del model
            recs.append(rec)
            print(json.dumps(rec), flush=True)
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outdir", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, small sizes: check that the script runs")
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 22, 24, 26], help="log2 bucket sizes, step_cost")
    ap.add_argument("--sync-log2", type=int, default=24, help="log2 bucket size, syncs")
    ap.add_argument("--memory-hidden", type=int, default=4096, help="MLP width, memory (2 × width² weights)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--parts", nargs="+", default=["step_cost", "syncs", "memory"])
    a = ap.parse_args(argv)
    if a.dry_run:
        device, sizes, sync_n, hidden, repeat = torch.device("cpu"), [12, 14], 1 << 14, 64, 2
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run", file=sys.stderr)
            return 2
        device, sizes, sync_n, hidden, repeat = torch.device("cuda"), a.sizes, 1 << a.sync_log2, a.memory_hidden, a.repeat
    a.outdir.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dry_run": a.dry_run,
            "torch": torch.__version__, "density": DENSITY}
    rc = 0
    for part in a.parts:
        try:
            recs = {"step_cost": lambda: step_cost(device, sizes, repeat), "syncs": lambda: syncs(device, sync_n),
                    "memory": lambda: memory(device, hidden, 3)}[part]()
        except Exception as err:  # noqa: BLE001 - the other parts still run
            recs, rc = {"error": f"{type(err).__name__}: {err}"[:1000]}, 1
            print(part, "FAILED:", recs["error"], file=sys.stderr)
        (a.outdir / f"{part}.json").write_text(json.dumps({**meta, "records": recs}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
