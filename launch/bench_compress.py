#!/usr/bin/env python
"""Compression benchmark: DRAGONN kernels against exact top-k, DGC-style threshold and random-k.

For every (size, density, dtype): each method selects from the same gradient-like buffers
(``randn · U^3``: heavy-tailed, 5 % exact zeros), 3 buffers rotated so caches flatter no one. Times are
medians over ``--repeat`` calls after ``--warmup`` calls; the floor is one read pass over the same buffer
(``g.sum()``), timed in alternation with each method (so ``floor_ms`` of a record comes from the same
time window and the ratio survives load from other processes). Quality columns for the same calls: the fraction of the exact top-k's squared mass that
was captured, the relative error ``||g - ĝ|| / ||g||`` of the sparse reconstruction, and kept count / k.

Methods
  floor_sum          g.sum(): one read pass, the lower bound for anything that reads g
  topk               torch.topk(|g|, k) + gather (exact)
  dgc                DGC (Lin et al., ICLR 2018): 1 % random sample → threshold, |g| ≥ thr → nonzero (threshold
                     ×0.8 while fewer than 0.8k, up to 10 times), then the exact top-k of the candidates when
                     more than k (launch/bench/common.py: dgc_select)
  randomk            launch/bench/baselines.py RandomKCompressor (randperm, k distinct)
  dragonn_reference  DragonnCompressor(kernel="reference"): pure PyTorch
  dragonn_cpu        DragonnCompressor(kernel="cpu"): C++ one-pass library (CPU)
  dragonn_triton     DragonnCompressor(kernel="triton"): Triton kernels (CUDA)
  dragonn_*_s1       the same with sample_ratio 0.01 (a threshold sample up to 10x larger than the default's)

Usage
  python launch/bench_compress.py                       # 2^20..2^26 (CPU) / 2^20..2^28 (GPU)
  python launch/bench_compress.py --quick               # 2^20, 2^22, 2^24, fp32
  python launch/bench_compress.py --json out.json --plot out.png --device cuda
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu" if "--device" not in sys.argv or "cpu" in sys.argv else "cuda")

import torch  # noqa: E402

from bench.common import DTYPES, dgc_select, pyplot, save_figure, sync, timed_ms, write_json  # noqa: E402
from ds_dragonn.compress import DragonnCompressor, target_k  # noqa: E402
from bench.baselines import RandomKCompressor  # noqa: E402
from ds_dragonn.compress.kernels import cpu_table, triton_available  # noqa: E402


# ---------------------------------------------------------------------------------------------- methods
def floor_sum(g, k, seed):
    return g.sum()


def topk_exact(g, k, seed):
    idx = torch.topk(g.abs(), k, sorted=False).indices
    return idx, g[idx]


def dgc(g, k, seed):
    """DGC's selection (:func:`bench.common.dgc_select`), its sample drawn from ``seed``."""
    idx = dgc_select(g, k, torch.Generator(device=g.device).manual_seed(seed))
    return idx, g[idx]


def compressor_method(comp):
    def run(g, k, seed):
        sel = comp.compress(g, seed)
        return sel.indices, sel.values
    return run


def methods_for(device: str, density: float, with_reference: bool):
    ms = {"floor_sum": floor_sum, "topk": topk_exact, "dgc": dgc,
          "randomk": compressor_method(RandomKCompressor(density))}
    if with_reference:
        ms["dragonn_reference"] = compressor_method(DragonnCompressor(density, kernel="reference"))
    if device == "cpu" and cpu_table.available():
        ms["dragonn_cpu"] = compressor_method(DragonnCompressor(density, kernel="cpu"))
        ms["dragonn_cpu_s1"] = compressor_method(DragonnCompressor(density, sample_ratio=0.01, kernel="cpu"))
    if device == "cuda" and triton_available():
        ms["dragonn_triton"] = compressor_method(DragonnCompressor(density, kernel="triton"))
        ms["dragonn_triton_s1"] = compressor_method(
            DragonnCompressor(density, sample_ratio=0.01, kernel="triton"))
    return ms


# ---------------------------------------------------------------------------------------------- harness
def make_inputs(n: int, dtype: torch.dtype, device: str, count: int = 3):
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(3)
        x[torch.rand(n, generator=gen) < 0.05] = 0.0
        out.append(x.to(dtype).to(device))
    return out


def quality(g: torch.Tensor, idx, vals, topk_sq: float, total_sq: float, k: int):
    kept_sq = float(vals.double().pow(2).sum())
    return {"topk_mass_captured": kept_sq / topk_sq if topk_sq > 0 else 1.0,
            "rel_error": math.sqrt(max(total_sq - kept_sq, 0.0) / total_sq) if total_sq > 0 else 0.0,
            "kept_over_k": int(idx.numel()) / k}


def time_method(fn, inputs, k, device, warmup, repeat, budget_s):
    """Median ms of ``fn`` and of the floor (``g.sum()``) timed in alternation on the same inputs.

    Pairing each call with a floor call makes the ratio robust to load from other processes on a
    shared machine (both medians come from the same time window).
    """
    for i in range(warmup):
        fn(inputs[i % len(inputs)], k, i)
    sync(device)
    times, floors, outs = [], [], []
    start = time.perf_counter()
    for i in range(repeat):
        g = inputs[i % len(inputs)]
        _, floor_ms = timed_ms(g.sum, device)
        out, ms = timed_ms(lambda: fn(g, k, 100 + i), device)
        floors.append(floor_ms)
        times.append(ms)
        outs.append((i % len(inputs), out))
        if len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    return statistics.median(times), statistics.median(floors), outs


def run(args) -> list[dict]:
    device = args.device
    records = []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for e in args.sizes:
            n = 1 << e
            inputs = make_inputs(n, dtype, device)
            sq = [g.double().pow(2) for g in inputs]
            totals = [float(s.sum()) for s in sq]
            for density in args.densities:
                k = target_k(n, density)
                topk_sq = [float(torch.topk(s, k, sorted=False).values.sum()) for s in sq]
                ms = methods_for(device, density, with_reference=e <= args.max_reference_exp)
                for name, fn in ms.items():
                    med, floor_ms, outs = time_method(fn, inputs, k, device, args.warmup, args.repeat,
                                                      args.budget_s)
                    if name == "floor_sum":
                        q = {"topk_mass_captured": None, "rel_error": None, "kept_over_k": None}
                    else:
                        qs = [quality(inputs[j], *o, topk_sq[j], totals[j], k) for j, o in outs]
                        q = {key: statistics.median(x[key] for x in qs) for key in qs[0]}
                    rec = {"method": name, "numel": n, "density": density, "dtype": dname, "device": device,
                           "median_ms": med, "floor_ms": floor_ms, **q, "threads": torch.get_num_threads()}
                    records.append(rec)
                    print_row(rec, flush=True)
                    if args.json:  # rewritten after every record: a long run that is cut short keeps its rows
                        write_json(args.json, records, indent=1)
            del inputs, sq
    return records


# ---------------------------------------------------------------------------------------------- output
HEADER = (f"{'dtype':5} {'numel':>9} {'dens':>6} {'method':20} {'ms':>9} {'floor ms':>8} {'x floor':>8} "
          f"{'mass':>6} {'rel_err':>7} {'kept/k':>6}")


def fmt(v, spec):
    return format(v, spec) if v is not None else "-"


def print_row(r, flush=False):
    print(f"{r['dtype']:5} 2^{int(math.log2(r['numel'])):<7} {r['density']:>6} {r['method']:20} "
          f"{r['median_ms']:9.2f} {r['floor_ms']:8.2f} {r['median_ms'] / r['floor_ms']:8.1f} {fmt(r['topk_mass_captured'], '6.3f'):>6} "
          f"{fmt(r['rel_error'], '7.3f'):>7} {fmt(r['kept_over_k'], '6.2f'):>6}", flush=flush)


def markdown_table(records) -> str:
    lines = ["| dtype | numel | density | method | median ms | paired floor ms | x floor | top-k mass | rel. error "
             "| kept/k |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['dtype']} | 2^{int(math.log2(r['numel']))} | {r['density']} | {r['method']} | "
                     f"{r['median_ms']:.2f} | {r['floor_ms']:.2f} | {r['median_ms'] / r['floor_ms']:.1f} | "
                     f"{fmt(r['topk_mass_captured'], '.3f')} | {fmt(r['rel_error'], '.3f')} | "
                     f"{fmt(r['kept_over_k'], '.2f')} |")
    return "\n".join(lines)


def plot(records, path):
    plt = pyplot()
    panels = sorted({(r["dtype"], r["density"]) for r in records})
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    for ax, (dname, dens) in zip(axes.flat, panels):
        sub = [r for r in records if r["dtype"] == dname and r["density"] == dens]
        for m in dict.fromkeys(r["method"] for r in sub):
            pts = sorted((r["numel"], r["median_ms"]) for r in sub if r["method"] == m)
            style = dict(linestyle="--", color="black") if m == "floor_sum" else dict(marker="o")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=m, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("elements")
        ax.set_ylabel("median ms")
        ax.set_title(f"{dname}, density {dens}, {sub[0]['device']} ({sub[0]['threads']} threads)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", type=int, nargs="+", help="log2 sizes (default 20..26 CPU, 20..28 GPU)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--budget-s", type=float, default=10.0, help="stop repeating a method after this (min 3 calls)")
    p.add_argument("--max-reference-exp", type=int, default=24,
                   help="largest log2 size at which the (slow) pure-PyTorch DRAGONN reference is timed")
    p.add_argument("--threads", type=int, default=None, help="torch/kernel threads (default: all cores)")
    p.add_argument("--quick", action="store_true", help="2^20, 2^22, 2^24; fp32; 5 repeats")
    p.add_argument("--json", type=Path, help="write the records here")
    p.add_argument("--plot", type=Path, help="write a PNG (time vs size, log-log) here")
    p.add_argument("--markdown", type=Path, help="write the table as markdown here")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = args.sizes or [20, 22, 24]
        args.dtypes = ["fp32"] if args.dtypes == ["fp32", "bf16"] else args.dtypes
        args.repeat = min(args.repeat, 5)
    if args.sizes is None:
        args.sizes = list(range(20, 29 if args.device == "cuda" else 27))
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU x{torch.get_num_threads()} threads"
    print(f"# bench_compress on {name}; torch {torch.__version__}; median of {args.repeat} "
          f"(after {args.warmup} warm-up), 3 rotating inputs")
    print(HEADER)
    records = run(args)
    if args.json:
        write_json(args.json, records, indent=1)
    if args.markdown:
        args.markdown.write_text(markdown_table(records) + "\n")
    if args.plot:
        plot(records, args.plot)
    return records


if __name__ == "__main__":
    main()
