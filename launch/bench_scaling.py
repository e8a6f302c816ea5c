"""World-size scaling of the exchange schemes: bytes per rank, owner imbalance and exchange time at 2, 4, 8 ranks.

For each world size it starts that many ranks on this machine (gloo over loopback, one process each).
Every rank computes, at every step, the real gradient of the link benchmark's model (the 24.2 M-parameter
MLP 784-4096-4096-1024-10 of ``launch/bench_link.py``, ``--layers``, at its seeded initialisation) on its own shard of
real MNIST batches, and reduces it with each scheme (``allgather``, ``partitioned``) at each density
(its own residuals per scheme and density, so error feedback runs as in training). A second gradient,
deliberately skewed (every large entry in the first 10 % of the buffer), measures the owner imbalance
where contiguous owner ranges fail. Per rank and timed step it records the bytes sent and received, the
owner imbalance (max over owners of the pairs received ÷ their mean) of the hash-permuted owners and, for
comparison, of contiguous ranges (DeepSpeed 0.19.7's and Ok-Topk's split), the exchange time (for
``partitioned`` it includes the owners' reduction and re-selection) and the decode time (P·k pairs for
``allgather``, k for ``partitioned``).

    python launch/bench_scaling.py --world-sizes 2,4,8 --json scaling.json --plot scaling.png
    OUT=docs/results/scaling bash launch/bench_scaling.sh   # the same after the set-up, with the table as text

Exchange times on loopback with more ranks than cores measure scheduling as much as the exchange; the
bytes and the imbalance do not depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (MLP_LAYERS, batches, build_mlp, cell, format_table, free_port, load_mnist, parse_layers,
                          pyplot, remove_shm, save_figure, write_json)

REPO = Path(__file__).resolve().parents[1]
WORLD_SIZES = "2,4,8"
DENSITIES = "0.01,0.001"
STEPS = 3              # timed steps
WARMUP = 1             # untimed first steps (allocations, kernel build)
SEED = 1234
SCHEMES = ("allgather", "partitioned")
SKEW_FRACTION = 0.1    # the skewed gradient's large entries sit in this leading fraction of the buffer


def get_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default=WORLD_SIZES, help="comma-separated rank counts")
    p.add_argument("--densities", default=DENSITIES, help="comma-separated densities")
    p.add_argument("--steps", type=int, default=STEPS, help="timed steps per configuration")
    p.add_argument("--layers", default=",".join(map(str, MLP_LAYERS)), type=parse_layers,
                   help="MLP widths (default: the link benchmark's model)")
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--plot", default=None, help="write the bytes-per-rank plot here (PNG)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per world size before its ranks are killed")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: this process is a rank
    return p.parse_args()


# -- inside a rank ----------------------------------------------------------------------------------------
class Recorder:
    """The compressor, keeping the indices it last returned (to count contiguous-owner loads)."""

    def __init__(self, inner):
        self.inner, self.name, self.last = inner, inner.name, None
        self.sends_non_finite = getattr(inner, "sends_non_finite", False)

    def compress(self, flat, seed):
        self.last = self.inner.compress(flat, seed)
        return self.last


def worker(args) -> None:
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    import torch.distributed as dist
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress import DragonnCompressor
    from ds_dragonn.exchange import AllgatherExchange, PartitionedExchange
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.pipeline import CompressedAllreduce

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    backend = TorchCommBackend()
    model = build_mlp(args.layers, SEED)
    x_tr, y_tr, _, _ = load_mnist(SEED)
    shards = batches(len(x_tr), rank, world, SEED)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)

    runs = []  # (gradient kind, scheme, density, pipeline, recorder)
    for density in [float(d) for d in args.densities.split(",")]:
        for kind, schemes in (("real", SCHEMES), ("skewed", ("partitioned",))):
            for scheme in schemes:
                rec = Recorder(DragonnCompressor(density))
                ex = (PartitionedExchange(backend, DragonnCompressor(density)) if scheme == "partitioned"
                      else AllgatherExchange(backend))
                runs.append((kind, scheme, density, CompressedAllreduce(rec, backend, ErrorFeedback(True), ex), rec))
    samples = {id(r[3]): [] for r in runs}
    skew_gen = torch.Generator().manual_seed(SEED + 7 * rank)
    for step in range(WARMUP + args.steps):
        idx = next(shards)
        model.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
        grads = [p.grad for p in params]
        skewed = torch.randn(n, generator=skew_gen) * 1e-3
        head = int(SKEW_FRACTION * n)
        skewed[:head] *= 1e3
        for kind, scheme, density, pipe, rec in runs:
            dist.barrier()
            _, s = pipe.reduce(grads if kind == "real" else skewed, (kind, scheme, density), seed=97 * step + 1,
                               postscale=1.0 / world)
            # contiguous owner ranges on the same selections: the split this design replaces
            contiguous = torch.bincount(rec.last.indices.long() * world // max(n, 1), minlength=world).double()
            dist.all_reduce(contiguous)
            if step >= WARMUP:
                samples[id(pipe)].append(dict(bytes_sent=s.bytes_sent, bytes_received=s.bytes_received,
                                              exchange_ms=s.exchange_ms, decode_ms=s.decode_ms,
                                              imbalance=s.imbalance, k=s.k, kept=s.kept,
                                              imbalance_contiguous=float(contiguous.max() / contiguous.mean())
                                              if contiguous.sum() else 0.0))
    gathered = [None] * world
    dist.all_gather_object(gathered, {str(i): samples[id(r[3])] for i, r in enumerate(runs)})
    if rank == 0:
        records = []
        for i, (kind, scheme, density, _, _) in enumerate(runs):
            per = [s for g in gathered for s in g[str(i)]]
            k = per[0]["k"]
            records.append(dict(
                exchange=scheme, world_size=world, density=density, gradient=kind, numel=n, k=k,
                bytes_sent_per_rank=statistics.mean(s["bytes_sent"] for s in per),
                bytes_sent_per_rank_max=max(s["bytes_sent"] for s in per),
                bytes_received_per_rank=statistics.mean(s["bytes_received"] for s in per),
                pairs_equivalent_sent=statistics.mean(s["bytes_sent"] for s in per) / 8,  # int32 + fp32
                lower_bound_pairs=2 * k * (world - 1) / world,
                kept_over_k=statistics.mean(s["kept"] for s in per) / k,
                imbalance=max(s["imbalance"] for s in per) if scheme == "partitioned" else None,
                imbalance_contiguous=max(s["imbalance_contiguous"] for s in per),
                exchange_ms=statistics.median(s["exchange_ms"] for s in per),
                decode_ms=statistics.median(s["decode_ms"] for s in per)))
        Path(args.worker).write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------------------
def launch(args, world: int, out: Path) -> list:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        cmd = [sys.executable, __file__, "--worker", str(out), "--densities", args.densities, "--steps",
               str(args.steps), "--layers", ",".join(map(str, args.layers))]
        log = open(out.with_suffix(f".rank{rank}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p, _ in procs):
            break
        time.sleep(0.2)
    for p, log in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()
    remove_shm(port)  # DeepSpeed's CPU allreduce leaves a /dev/shm file per rank and port behind
    failed = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = out.with_suffix(f".rank{failed[0]}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{world} ranks: ranks {failed} failed (exit {[procs[r][0].returncode for r in failed]})\n{tail}")
    return json.loads(out.read_text())


COLUMNS = (("exchange", "exchange", "{}"), ("grad", "gradient", "{}"), ("P", "world_size", "{}"),
           ("density", "density", "{}"), ("k", "k", "{}"), ("KB sent/rank", "bytes_sent_per_rank", "{:.1f}"),
           ("KB recv/rank", "bytes_received_per_rank", "{:.1f}"), ("pairs sent", "pairs_equivalent_sent", "{:.0f}"),
           ("2k(P-1)/P", "lower_bound_pairs", "{:.0f}"), ("imbalance", "imbalance", "{:.3f}"),
           ("imb. contiguous", "imbalance_contiguous", "{:.3f}"), ("exchange ms", "exchange_ms", "{:.1f}"),
           ("decode ms", "decode_ms", "{:.1f}"))


def table(records: list) -> str:
    """The records as a text table (bytes in KB)."""
    rows = [[cell(r[key] / 1e3 if key.startswith("bytes") and r[key] is not None else r[key], fmt)
             for _, key, fmt in COLUMNS] for r in records]
    return format_table([h for h, _, _ in COLUMNS], rows)


def plot(records: list, path: str) -> None:
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    real = [r for r in records if r["gradient"] == "real"]
    for scheme in SCHEMES:
        for density in sorted({r["density"] for r in real}, reverse=True):
            pts = sorted((r["world_size"], r["bytes_sent_per_rank"] / 1e6) for r in real
                         if r["exchange"] == scheme and r["density"] == density)
            if pts:
                ax.plot(*zip(*pts), marker="o", linestyle="-" if scheme == "partitioned" else "--",
                        label=f"{scheme}, density {density}")
        bound = sorted({(r["world_size"], r["lower_bound_pairs"] * 8 / 1e6, r["density"]) for r in real})
    for density in sorted({r["density"] for r in real}, reverse=True):
        pts = sorted((p, b) for p, b, d in bound if d == density)
        ax.plot(*zip(*pts), color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("MB sent per rank per step")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["world_size"] for r in records}))
    ax.set_title("bytes per rank (dotted: lower bound 2k(P-1)/P pairs)")
    ax.legend(fontsize=8, loc="lower right")
    part = [r for r in records if r["exchange"] == "partitioned"]
    for kind, marker in (("real", "o"), ("skewed", "s")):
        for density in sorted({r["density"] for r in part}, reverse=True):
            pts = sorted((r["world_size"], r["imbalance"], r["imbalance_contiguous"]) for r in part
                         if r["gradient"] == kind and r["density"] == density)
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"permuted, {kind}, d={density}")
            ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker=marker, linestyle="--",
                     label=f"contiguous, {kind}, d={density}")
    ax2.set_xlabel("world size (ranks)")
    ax2.set_ylabel("owner imbalance (max / mean pairs)")
    ax2.set_yscale("log")
    ax2.set_xticks(sorted({r["world_size"] for r in records}))
    ax2.set_title("owner imbalance: permuted vs contiguous ranges")
    ax2.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main():
    args = get_args()
    if args.worker:
        return worker(args)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in [int(w) for w in args.world_sizes.split(",")]:
            t0 = time.monotonic()
            records += launch(args, world, Path(tmp) / f"world{world}.json")
            print(f"[bench_scaling] {world} ranks done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    records.sort(key=lambda r: (r["gradient"], r["exchange"], -r["density"], r["world_size"]))
    print(table(records))
    if args.json:
        write_json(args.json, {"cpu_count": os.cpu_count(), "torch": torch.__version__, "records": records}, indent=1)
    if args.plot:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
