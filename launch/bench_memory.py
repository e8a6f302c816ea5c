"""Per-rank persistent memory of ds_dragonn against dense DeepSpeed of the same config, in bytes per parameter.

Two measures, each at ZeRO 0-3, bf16 and fp32, the gradient and momentum modes (``policy: always``, short
warm-ups), flat and (``--node``) 2 x 2 node-aware:

    exact   the bytes of every tensor the hook keeps between steps (``launch.bench.memory_budget.persistent_tensors``:
            residuals, working copies, momenta, decode buffers, frozen variance, server residuals), by component
    rss     the process's VmRSS after the steps and its peak VmHWM (reset after start-up), CPU; on CUDA
            ``torch.cuda.memory_allocated`` / ``max_memory_allocated``; against the same config without the
            block (``dense``), each case its own processes

    python launch/bench_memory.py --measure exact              # tiny model, every case, one launch per layout
    python launch/bench_memory.py --measure rss --layers 784,4096,3072,10 --steps 4

prints a table and writes memory_<measure>.json and memory_<measure>.png under --out (docs/results/memory).
Ranks are this script's own processes (``--worker``) on gloo, as tests/multiproc.py launches them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launch.bench.common import free_port, format_table, pyplot, remove_shm, save_figure, write_json  # noqa: E402

MODES = ("dense", "gradient", "momentum")


def cases(stages, dtypes, layouts, modes=MODES) -> list:
    return [{"stage": s, "dtype": d, "layout": lay, "mode": m}
            for lay in layouts for s in stages for d in dtypes for m in modes]


def ds_config(case: dict, warmup: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": case["stage"]}, "steps_per_print": 10**6}
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if case["mode"] != "dense":
        cfg["dragonn"] = {"enabled": True, "policy": "always", "min_compress_numel": 1, "log_interval": 0,
                          "compress": case["mode"], "warmup_steps": warmup,
                          "density_warmup_steps": 0, "hierarchy": "node" if case["layout"] == "node" else "flat"}
    return cfg


def _status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_peak(cuda: bool) -> None:
    if cuda:
        import torch
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS


def run_case(case: dict, layers, steps: int, warmup: int, rank: int) -> dict:
    """One engine of ``case``: ``steps`` steps, then the exact count and the memory readings."""
    import torch

    import ds_dragonn
    from launch.bench.memory_budget import deepspeed_storages, persistent_tensors
    from launch.bench.common import build_mlp

    cuda = torch.cuda.is_available()
    model = build_mlp(layers, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    gc.collect()
    _reset_peak(cuda)
    start = torch.cuda.memory_allocated() if cuda else _status()["VmRSS"]
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(),
                                       config=ds_config(case, warmup))
    dtype = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(8, layers[0], generator=g).to(dtype).to(engine.device)
        y = torch.randint(0, layers[-1], (8,), generator=g).to(engine.device)
        engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
        engine.step()
    if cuda:
        torch.cuda.synchronize()
        steady, peak = torch.cuda.memory_allocated() - start, torch.cuda.max_memory_allocated() - start
    else:
        st = _status()
        steady, peak = st["VmRSS"] - start, st["VmHWM"] - start
    hook = getattr(engine, "dragonn", None)
    parts = {}
    if hook is not None:
        for path, (nbytes, _) in persistent_tensors(hook, deepspeed_storages(engine)).items():
            parts[path] = parts.get(path, 0) + nbytes
    result = {**case, "params": n_params, "steady_bytes": steady, "peak_bytes": peak, "parts": parts,
              "transactional": bool(getattr(hook, "transactional", False)),
              "exact_bytes": sum(parts.values())}
    del engine, hook
    gc.collect()
    return result


def worker(rank: int, world: int, spec_path: str) -> None:
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    spec = json.loads(Path(spec_path).read_text())
    results = []
    for case in spec["cases"]:
        try:
            results.append(run_case(case, spec["layers"], spec["steps"], spec["warmup"], rank))
        except Exception as exc:  # a layout a stage does not support: recorded, the others go on
            results.append({**case, "error": f"{type(exc).__name__}: {exc}"})
        if spec.get("one_case"):
            break
    Path(spec["out"]).joinpath(f"rank{rank}.json").write_text(json.dumps(results))


def launch(case_list: list, layers, steps: int, warmup: int, world: int, per_node: int, tmp: Path,
           one_case: bool, timeout: float) -> list:
    """Run ``case_list`` in ``world`` fresh ranks (``per_node`` ranks per node); rank 0's results."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"cases": case_list, "layers": list(layers), "steps": steps, "warmup": warmup,
                                "out": str(tmp), "one_case": one_case}))
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
                   LOCAL_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        env.setdefault("DS_ACCELERATOR", "cpu")
        log = open(tmp / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(rank), str(world), str(spec)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    finally:  # also when the caller is interrupted: no rank outlives the launch, nor its /dev/shm files
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        remove_shm(port)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"ranks failed, see {tmp}/rank*.log:\n" + (tmp / "rank0.log").read_text()[-3000:])
    return json.loads((tmp / "rank0.json").read_text())


def summarise(results: list, measure: str) -> list:
    """Rows with bytes per parameter, DRAGONN against the dense case of the same (stage, dtype, layout)."""
    from launch.bench.memory_budget import component_of
    dense = {(r["stage"], r["dtype"], r["layout"]): r for r in results if r["mode"] == "dense" and "error" not in r}
    rows = []
    for r in results:
        if r["mode"] == "dense":
            continue
        row = {k: r[k] for k in ("stage", "dtype", "layout", "mode")}
        if "error" in r:
            rows.append({**row, "error": r["error"]})
            continue
        n = r["params"]
        by = {}
        for path, nbytes in r["parts"].items():
            by[component_of(path)] = by.get(component_of(path), 0) + nbytes
        row.update(params=n, transactional=r["transactional"], exact_bpp=r["exact_bytes"] / n,
                   parts_bpp={k: v / n for k, v in sorted(by.items())})
        d = dense.get((r["stage"], r["dtype"], r["layout"]))
        if measure == "rss" and d is not None:
            row.update(dense_steady_mb=d["steady_bytes"] / 2**20,
                       extra_steady_bpp=(r["steady_bytes"] - d["steady_bytes"]) / n,
                       extra_peak_bpp=(r["peak_bytes"] - d["peak_bytes"]) / n)
        rows.append(row)
    return rows


def print_table(rows: list, measure: str) -> None:
    header = ["stage", "dtype", "layout", "mode", "txn", "exact B/param"]
    header += ["dense MB", "extra steady", "extra peak"] if measure == "rss" else ["by component"]
    body = []
    for r in rows:
        head = [str(r["stage"]), r["dtype"], r["layout"], r["mode"]]
        if "error" in r:
            body.append(head + ["", " ".join(r["error"].split())[-120:]] + [""] * (len(header) - 6))
            continue
        body.append(head + [str(r["transactional"])[0], f"{r['exact_bpp']:.2f}"]
                    + ([f"{r.get('dense_steady_mb', float('nan')):.0f}", f"{r.get('extra_steady_bpp', 0):+.1f}",
                        f"{r.get('extra_peak_bpp', 0):+.1f}"] if measure == "rss" else
                       [", ".join(f"{k} {v:.2f}" for k, v in r["parts_bpp"].items())]))
    print(format_table(header, body))


def plot(rows: list, measure: str, path: Path) -> None:
    plt = pyplot()
    ok = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(ok)), 4))
    labels = [f"Z{r['stage']} {r['dtype']} {r['layout'][0]} {r['mode'][0]}" for r in ok]
    key = "extra_steady_bpp" if measure == "rss" else "exact_bpp"
    ax.bar(range(len(ok)), [r.get(key, 0) for r in ok], color=["C0" if r["mode"] == "gradient" else "C1" for r in ok])
    if measure == "rss":
        ax.plot(range(len(ok)), [r.get("extra_peak_bpp", 0) for r in ok], "k_", markersize=12, label="peak")
        ax.legend()
    ax.set_xticks(range(len(ok)), labels, rotation=70, fontsize=7)
    ax.set_ylabel("bytes per parameter, per rank" + (" (over dense)" if measure == "rss" else " (persistent)"))
    ax.set_title(f"ds_dragonn persistent memory ({measure}); Z stage, dtype, flat/node, gradient/momentum",
                 fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def _choices(allowed, kind=str):
    """An argparse type: a comma-separated list, each item one of ``allowed``."""
    names = {str(a) for a in allowed}

    def parse(text: str) -> list:
        items = [v.strip() for v in text.split(",") if v.strip()]
        if not items or any(v not in names for v in items):
            raise argparse.ArgumentTypeError(f"{text!r}: each of {', '.join(map(str, allowed))} (comma-separated)")
        return [kind(v) for v in items]
    return parse


def _layers(text: str) -> tuple:
    from launch.bench.common import parse_layers
    try:
        layers = parse_layers(text)
    except ValueError:
        layers = ()
    if len(layers) < 2 or min(layers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: MLP widths, at least two positive ints (e.g. 64,256,10)")
    return layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", choices=("exact", "rss"), default="exact")
    ap.add_argument("--layers", type=_layers, default=None, help="MLP widths (exact: 64,256,10; rss: 784,4096,3072,10 = 15.8 M)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="dense warm-up steps (the momentum mode freezes after)")
    ap.add_argument("--stages", type=_choices((0, 1, 2, 3), int), default=[0, 1, 2, 3], help="ZeRO stages, e.g. 0,2")
    ap.add_argument("--dtypes", type=_choices(("bf16", "fp32")), default=["bf16", "fp32"])
    ap.add_argument("--modes", type=_choices(MODES), default=list(MODES))
    ap.add_argument("--node", action="store_true", help="also 2 x 2 node-aware (4 ranks)")
    ap.add_argument("--out", default=str(REPO / "docs/results/memory"))
    ap.add_argument("--tag", default="", help="suffix of the output files (e.g. _before)")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0 (got {args.steps}, {args.warmup})")
    layers = args.layers or _layers("64,256,10" if args.measure == "exact" else "784,4096,3072,10")
    stages, dtypes, modes = args.stages, args.dtypes, tuple(args.modes)
    out = Path(args.out)
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    results = []
    for layout, world, per_node in [("flat", 2, 2)] + ([("node", 4, 2)] if args.node else []):
        todo = cases(stages, dtypes, [layout], modes)
        if args.measure == "exact":
            results += launch(todo, layers, args.steps, args.warmup, world, per_node, tmp, False, args.timeout)
        else:
            for case in todo:
                results += launch([case], layers, args.steps, args.warmup, world, per_node, tmp, True, args.timeout)
                print(json.dumps({k: v for k, v in results[-1].items() if k != "parts"}), flush=True)
    rows = summarise(results, args.measure)
    print_table(rows, args.measure)
    write_json(out / f"memory_{args.measure}{args.tag}.json",
               {"measure": args.measure, "layers": list(layers), "steps": args.steps, "warmup": args.warmup,
                "rows": rows, "raw": [{k: v for k, v in r.items()} for r in results]})
    plot(rows, args.measure, out / f"memory_{args.measure}{args.tag}.png")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
