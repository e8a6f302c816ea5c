"""Memory per GPU projected to large models: dense DeepSpeed's model state against DRAGONN's own state.

    python launch/bench/memory_projection.py                       # the documented cases, table + JSON + PNG
    python launch/bench/memory_projection.py --params 13e9 --nodes 4 --gpus-per-node 8

For each ZeRO stage and layout it reports the bytes per GPU of:

- dense: mixed-precision Adam's model state (ZeRO paper, Rajbhandari et al. SC 2020, Sec. 3: 2 bytes of
  16-bit weights, 2 of 16-bit gradients, 12 of fp32 master weights and Adam's two moments per parameter),
  partitioned over the P data-parallel ranks as ZeRO does: stage 0 nothing, 1 the 12, 2 the 12 + 2, 3 all 16;
- DRAGONN: the stated budget per parameter of ``launch.bench.memory_budget.budget`` (the one
  ``tests/test_memory_budget.py`` holds the code to), every parameter in a compressed bucket;

and the largest model whose state fits in 80 GB (H100) and 141 GB (H200), dense and with DRAGONN.

Assumptions (state only; what the projection leaves out): no activations, no temporary buffers, no
fragmentation, no DeepSpeed bucket scratch (``reduce_bucket_size``), no ZeRO-3 prefetch; bf16 wire; the O(k)
bookkeeping left out (≤ 8 · density · P bytes per parameter); bf16's default: no working copies (a skipped step
returns what it sent, O(k)). ``--txn`` adds the step transaction (``advanced.exact_skipped_steps: true``, the fp16
default).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
for _path in (REPO, REPO / "launch"):  # the package; launch/ for bench.common
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from launch.bench.memory_budget import budget  # noqa: E402

GB = 1e9
CAPACITIES_GB = {"H100 80 GB": 80.0, "H200 141 GB": 141.0}
#: the documented cases: (name, parameters, nodes, GPUs per node)
CASES = (("7B on 2 x 8", 7e9, 2, 8), ("7B on 16 x 8", 7e9, 16, 8), ("70B on 8 x 8", 70e9, 8, 8))
MODES = ("gradient", "momentum")
LAYOUTS = ("flat", "node")


def dense_bytes_per_param(stage: int, world: int) -> float:
    """Mixed-precision Adam's model state per parameter per GPU at ZeRO ``stage`` over ``world`` ranks."""
    if stage not in (0, 1, 2, 3) or world < 1:
        raise ValueError(f"stage must be 0-3 and world >= 1, got stage={stage} world={world}")
    weights, grads, optim = 2.0, 2.0, 12.0
    if stage >= 1:
        optim /= world
    if stage >= 2:
        grads /= world
    if stage >= 3:
        weights /= world
    return weights + grads + optim


def dragonn_bytes_per_param(compress: str, stage: int, world: int, per_node: int, txn: bool = False,
                            exchange: Optional[str] = None) -> float:
    """DRAGONN's stated budget per parameter per GPU (``launch.bench.memory_budget.budget``, bf16 wire): ``per_node``
    ranks per node (1: flat). The exchange: ZeRO 1-3 flat reduce-scatter, else allgather."""
    if exchange is None:
        exchange = "reduce_scatter" if stage >= 1 and per_node == 1 else "allgather"
    return sum(budget(compress, torch.bfloat16, txn, stage=stage, world=world, per_node=per_node,
                      exchange=exchange).values())


def largest_model(capacity_gb: float, per_param: float) -> float:
    """Parameters whose state (``per_param`` bytes each) fits in ``capacity_gb``."""
    return capacity_gb * GB / per_param


def project(params: float, nodes: int, gpus_per_node: int, txn: bool = False) -> List[Dict]:
    """One row per (ZeRO stage, layout, mode): bytes per parameter and GB per GPU, dense and DRAGONN, and
    the largest model that fits each capacity."""
    world = nodes * gpus_per_node
    rows = []
    for stage in range(4):
        dense = dense_bytes_per_param(stage, world)
        for layout in LAYOUTS:
            if layout == "node" and nodes < 2:
                continue
            per_node = gpus_per_node if layout == "node" else 1
            for mode in MODES:
                extra = dragonn_bytes_per_param(mode, stage, world, per_node, txn)
                row = {"stage": stage, "layout": layout, "mode": mode, "world": world, "params": params,
                       "dense_B_per_param": dense, "dragonn_B_per_param": extra,
                       "dense_GB": params * dense / GB, "dragonn_GB": params * extra / GB,
                       "total_GB": params * (dense + extra) / GB}
                for name, cap in CAPACITIES_GB.items():
                    row[f"fits_dense_{name}"] = largest_model(cap, dense)
                    row[f"fits_dragonn_{name}"] = largest_model(cap, dense + extra)
                rows.append(row)
    return rows


def _table(name: str, rows: List[Dict]) -> str:
    from bench.common import format_table
    caps = list(CAPACITIES_GB)
    header = ["ZeRO", "layout", "mode", "dense B/param", "DRAGONN B/param", "dense GB", "+DRAGONN GB"] + \
             [f"largest, {c} (dense / DRAGONN)" for c in caps]
    body = [[str(r["stage"]), r["layout"], r["mode"], f"{r['dense_B_per_param']:.2f}", f"{r['dragonn_B_per_param']:.2f}",
             f"{r['dense_GB']:.1f}", f"{r['dragonn_GB']:.1f}"] +
            [f"{r[f'fits_dense_{c}'] / 1e9:.1f}B / {r[f'fits_dragonn_{c}'] / 1e9:.1f}B" for c in caps] for r in rows]
    return f"{name} ({rows[0]['world']} GPUs)\n" + format_table(header, body)


def _plot(results: Dict[str, List[Dict]], path: Path) -> Path:
    from bench.common import pyplot, save_figure
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], results.items()):
        rows = [r for r in rows if r["mode"] == "momentum"]
        labels = [f"Z{r['stage']} {r['layout']}" for r in rows]
        xs = range(len(rows))
        ax.bar(xs, [r["dense_GB"] for r in rows], label="dense model state")
        ax.bar(xs, [r["dragonn_GB"] for r in rows], bottom=[r["dense_GB"] for r in rows], label="+ DRAGONN (momentum)")
        for cap in CAPACITIES_GB.values():
            ax.axhline(cap, color="grey", lw=0.8, ls="--")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=45, ha="right")
        ax.set_ylabel("GB per GPU")
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.5 * min(r["dense_GB"] for r in rows))
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None) -> Dict[str, List[Dict]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, help="model parameters (e.g. 7e9); with --nodes and --gpus-per-node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--txn", action="store_true", help="with the step transaction (advanced.exact_skipped_steps: true)")
    p.add_argument("--out", type=Path, default=None, help="write memory_projection.json and .png here")
    args = p.parse_args(argv)
    if args.params is not None and (args.params <= 0 or args.nodes < 1 or args.gpus_per_node < 1):
        p.error(f"--params must be > 0 and --nodes/--gpus-per-node >= 1 (got {args.params:g}, {args.nodes}, "
                f"{args.gpus_per_node})")
    cases = ([(f"{args.params / 1e9:g}B on {args.nodes} x {args.gpus_per_node}", args.params, args.nodes,
               args.gpus_per_node)] if args.params is not None else CASES)
    results = {name: project(n, nodes, per, txn=args.txn) for name, n, nodes, per in cases}
    for name, rows in results.items():
        print(_table(name, rows) + "\n")
    if args.out is not None:
        from bench.common import write_json
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "memory_projection.json",
                   {"assumptions": __doc__.split("Assumptions")[1].strip(), "txn": args.txn, "cases": results})
        _plot(results, args.out / "memory_projection.png")
        print(f"wrote {args.out / 'memory_projection.json'} and .png")
    return results


if __name__ == "__main__":
    main()
