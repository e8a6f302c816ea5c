"""Benchmark: the allgather exchange over MPI (mpi4py) vs torch.distributed (gloo on CPU), same buffers.

Launch (2 ranks; MASTER_ADDR=127.0.0.1 is preset from MPICH's variables):
    mpiexec -n 2 python launch/bench_exchange.py --json runs/exchange_mpi_vs_gloo.json

Per size n (2^20 .. 2^25 fp32 elements), every rank compresses its own gradient once with DRAGONN
(density 0.01) and then exchanges that same selection through both transports
(``ds_dragonn.exchange.allgather_exchange``: header allgather + payload allgather), alternating which
transport goes first. Each timed call starts after an MPI barrier; a call's time is the slowest rank's;
the table gives the median (and 10th–90th percentile) over repetitions. Both transports' gathered pairs
are checked to be bit-identical. Only rank 0 prints and writes the JSON.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from bench.common import percentile, write_json
from ds_dragonn.comm.mpi_env import setup_mpi_env

# -- defaults (units in comments) -----------------------------------------------------------------------
MIN_LOG2, MAX_LOG2 = 20, 25   # buffer sizes 2^20 .. 2^25 elements (fp32)
DENSITY = 0.01                # fraction of elements each rank selects
REPS = 15                     # timed repetitions per size and transport
WARMUP = 3                    # untimed repetitions per size and transport


def get_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-log2", type=int, default=MIN_LOG2)
    p.add_argument("--max-log2", type=int, default=MAX_LOG2)
    p.add_argument("--density", type=float, default=DENSITY)
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--json", type=str, default=None, help="write results here (rank 0)")
    return p.parse_args()


def main():
    args = get_args()
    setup_mpi_env()
    import deepspeed
    import torch
    from mpi4py import MPI

    from ds_dragonn.comm.mpi_backend import MPICommBackend
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress import DragonnCompressor
    from ds_dragonn.exchange import allgather_exchange

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    backends = {"torch": TorchCommBackend(), "mpi": MPICommBackend()}
    compressor = DragonnCompressor(args.density)
    load_at_start = os.getloadavg()[0]
    if rank == 0:
        print(f"world_size={world} density={args.density} reps={args.reps} warmup={args.warmup} "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} load_avg={load_at_start:.2f} "
              f"mpi={MPI.Get_library_version().splitlines()[0].strip()}", flush=True)

    def timed(name, sel, n):
        comm.Barrier()
        t0 = time.perf_counter()
        out = allgather_exchange(sel, n, torch.float32, backends[name])
        dt = time.perf_counter() - t0
        return comm.allreduce(dt, op=MPI.MAX) * 1e3, out

    rows = []
    for log2 in range(args.min_log2, args.max_log2 + 1):
        n = 1 << log2
        gen = torch.Generator().manual_seed(1000 * log2 + rank)
        grad = torch.randn(n, generator=gen)
        sel = compressor.compress(grad, seed=log2)
        times = {"torch": [], "mpi": []}
        for rep in range(args.warmup + args.reps):
            order = ("torch", "mpi") if rep % 2 == 0 else ("mpi", "torch")
            outs = {}
            for name in order:
                ms, outs[name] = timed(name, sel, n)
                if rep >= args.warmup:
                    times[name].append(ms)
            if rep == 0:  # same bytes through both transports
                for a, b in zip(outs["torch"].indices + outs["torch"].values, outs["mpi"].indices + outs["mpi"].values):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "transports gathered different pairs"
        counts = comm.allgather(sel.count)
        row = {"numel": n, "pairs_per_rank": counts, "bytes_sent_per_rank": outs["mpi"].bytes_sent,
               **{f"{k}_ms_median": statistics.median(v) for k, v in times.items()},
               **{f"{k}_ms_p10": percentile(v, 0.1) for k, v in times.items()},
               **{f"{k}_ms_p90": percentile(v, 0.9) for k, v in times.items()},
               "times_ms": times}
        row["mpi_over_torch"] = row["mpi_ms_median"] / row["torch_ms_median"]
        rows.append(row)

    if rank == 0:
        head = (f"{'numel':>10} | {'pairs/rank':>10} | {'sent KiB':>8} | {'torch/gloo ms (p10-p90)':>24} | "
                f"{'mpi ms (p10-p90)':>22} | {'mpi/torch':>9}")
        print(head)
        print("-" * len(head))
        for r in rows:
            print(f"{'2^%d' % (r['numel'].bit_length() - 1):>10} | {max(r['pairs_per_rank']):>10} | "
                  f"{r['bytes_sent_per_rank'] / 1024:>8.1f} | "
                  f"{r['torch_ms_median']:>8.3f} ({r['torch_ms_p10']:.3f}-{r['torch_ms_p90']:.3f}) | "
                  f"{r['mpi_ms_median']:>7.3f} ({r['mpi_ms_p10']:.3f}-{r['mpi_ms_p90']:.3f}) | "
                  f"{r['mpi_over_torch']:>9.3f}")
        geo = statistics.geometric_mean([r["mpi_over_torch"] for r in rows])
        worst = max(r["mpi_over_torch"] for r in rows)
        print(f"mpi/torch: geometric mean {geo:.3f}, worst {worst:.3f} (target <= 1.1)")
        if args.json:
            write_json(args.json, {"world_size": world, "density": args.density, "reps": args.reps,
                                   "warmup": args.warmup, "load_avg_1min_at_start": load_at_start,
                                   "load_avg_1min_at_end": os.getloadavg()[0],
                                   "host": platform.node(), "cpus": os.cpu_count(),
                                   "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
                                   "torch": torch.__version__, "mpi_over_torch_geomean": geo,
                                   "mpi_over_torch_worst": worst, "rows": rows})
    comm.Barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
