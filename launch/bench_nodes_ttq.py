"""Time to target on two nodes: how long each exchange takes to train the LM to a held-out loss, 2 nodes x 2 ranks
with a throttled link between the nodes. No root: it reads the records of two earlier measurements.

    time to target = steps to target (quality, 2 x 2 on loopback) x step time (timing, 2 x 2 across the link)

1. Quality: ``launch/convergence.py --quick --nodes 2 --tasks lm --lm-steps 1000`` (one ``deepspeed`` launcher
   per node on loopback, the smaller ByteGPT; the exchange's arithmetic does not depend on the link). Each mode's
   curve is the mean over its seeds of the held-out loss at each evaluation (every 20 steps).
2. Target: the reference run's (``dense_fp32``, else ``dense``) mean held-out loss at --target-fraction (80 %)
   of its run. Steps to target: the first evaluation at or below it, interpolated between it and the one before
   (``bench_ttq.steps_to_target``); a mode that never gets there is "not reached", with its final gap.
3. Timing: ``sudo python launch/bench_nodes.py --task lm --links ...`` (network namespaces, tc-throttled veth):
   per-step ms in each mode's steady state, from a (90 − 30)-step difference, and inter-node bytes from the
   link's own counters.
4. Seconds = ``bench_ttq.seconds_at``: a DRAGONN run's dense warm-up steps and the momentum mode's variance
   refreshes (every ``variance_refresh_steps`` after the warm-up) at the dense step they really take (DeepSpeed's
   own allreduce, bf16 on this bf16 engine; ZeRO 3: the dense ZeRO-3 + hpZ step), its density warm-up linear in
   the density between the two, every other step at the mode's steady step.

Modes without a quality run (``none``: no exchange, the physical limit; ``part_*``, ``zero2_*``) are left out;
each row names the quality run it took (``MODE_RUN``).
Dense ZeRO 3 with hpZ trains as dense ZeRO 3 does (hpZ changes only where the parameters are gathered from), so
both take ``zero3_dense``'s curve.

    python launch/bench_nodes_ttq.py --quality docs/results/nodes/lm_2x2_*.json --timing docs/results/nodes/nodes_lm*.json \\
        --out docs/results/nodes/ttq

prints a table per link and writes ``ttq_nodes.json`` and ``ttq_nodes.png`` (held-out loss against seconds on
the --plot-link) under --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_ttq, bench.common beside this script
from bench_ttq import loss_at, seconds_at, steps_to_target  # noqa: E402
from bench.common import pyplot, save_figure, write_json  # noqa: E402

#: timing mode (bench_nodes.py) -> (its quality runs (convergence.py), the first one recorded is used; the timing
#: mode whose step a dense step costs). The dense allreduces of this bf16 engine differ only in the rounding of
#: the sum (its gradients are bf16 either way), so ``dense``'s curve stands in where a dense run is missing.
MODE_RUN = {
    "dense_fp32": (("dense_fp32", "dense"), None),
    "dense_bf16": (("dense",), None),
    "hier_bf16": (("hier_bf16", "dense"), None),
    "dragonn_flat": (("flat_0.01",), "dense_bf16"),
    "dragonn_node": (("node_0.01",), "dense_bf16"),
    "zero3_dense": (("zero3_dense",), None),
    "zero3_hpz_dense": (("zero3_dense",), None),
    "zero3_hpz_dragonn": (("zero3_hpz_0.01",), "zero3_hpz_dense"),
    "diloco_flat": (("diloco_flat",), "dense_bf16"),
    "diloco_node": (("diloco_node",), "dense_bf16"),
}
REFERENCES = ("dense_fp32", "dense")
TARGET_FRACTION = 0.8
REFRESH_STEPS = 100  # variance_refresh_steps' default: the momentum mode's dense refresh interval
DENSITY_WARMUP_START = 0.25


def mean_curves(records: List[dict]) -> Dict[str, dict]:
    """Per run: ``{"curve": [{"step", "loss"}], "seeds", "final", "record"}``, the held-out loss averaged over
    seeds at the evaluation steps every seed has."""
    by_run: Dict[str, List[dict]] = {}
    for r in records:
        if r.get("task", "lm") == "lm":
            by_run.setdefault(r["run"], []).append(r)
    out = {}
    for run, rs in by_run.items():
        steps = sorted(set.intersection(*({h["step"] for h in r["history"]} for r in rs)))
        curve = [{"step": s, "loss": statistics.mean(next(h["value"] for h in r["history"] if h["step"] == s)
                                                     for r in rs)} for s in steps]
        out[run] = {"curve": curve, "seeds": sorted(r["seed"] for r in rs),
                    "final": statistics.mean(r["value"] for r in rs), "record": rs[0]}
    return out


def charges(record: dict) -> dict:
    """The dense steps of a quality run that :func:`seconds_at` charges at the dense step: its dense warm-up, the
    momentum mode's refreshes, its density warm-up (none for a dense run)."""
    warm = record.get("warmup") or {}
    if not warm:
        return {"dense_steps": 0, "refresh_steps": 0, "density_warmup": None}
    # compress auto: the momentum mode for this AdamW at every ZeRO stage; named gradient runs and the local
    # steps' pseudo-gradient have no variance refreshes
    momentum = record.get("density", 1.0) < 1.0 and "gradient" not in record["run"] and \
        not record["run"].startswith(("diloco", "local"))
    return {"dense_steps": int(warm.get("warmup_steps") or 0),
            "refresh_steps": REFRESH_STEPS if momentum else 0,
            "density_warmup": ({"steps": int(warm.get("density_warmup_steps") or 0),
                                "start": warm.get("density_warmup_start", DENSITY_WARMUP_START),
                                "density": record["density"]} if record.get("density", 1.0) < 1.0 else None)}


def build_rows(curves: Dict[str, dict], timing: List[dict], fraction: float = TARGET_FRACTION) -> dict:
    """The target and, per link and mode, steps and seconds to it (None where not reached)."""
    ref = next((r for r in REFERENCES if r in curves), None)
    if ref is None:
        raise SystemExit(f"bench_nodes_ttq: no reference quality run ({' or '.join(REFERENCES)})")
    ref_steps = curves[ref]["record"]["steps"]
    target = loss_at(curves[ref]["curve"], fraction * ref_steps)
    rows = []
    for link in dict.fromkeys(t["link"] for t in timing):
        ms = {t["mode"]: t["ms_per_step"] for t in timing if t["link"] == link}
        mb = {t["mode"]: t["inter_node_mb_per_step_per_node"] for t in timing if t["link"] == link}
        for mode, (runs, dense_mode) in MODE_RUN.items():
            run = next((r for r in runs if r in curves), None)
            if mode not in ms or run is None:
                continue
            c = curves[run]
            steps = steps_to_target(c["curve"], target)
            dense_ms = ms.get(dense_mode) if dense_mode else None
            charge = charges(c["record"]) if dense_ms is not None else {}
            seconds = seconds_at(steps, ms[mode], dense_ms, **charge) if steps is not None else None
            rows.append({"link": link, "mode": mode, "quality_run": run, "seeds": c["seeds"],
                         "ms_per_step": ms[mode], "dense_ms_charged": dense_ms, **charge,
                         "inter_node_mb_per_step_per_node": mb[mode], "steps_to_target": steps,
                         "seconds_to_target": seconds, "final_loss": c["final"],
                         "final_gap_pct": (c["final"] / target - 1) * 100})
    return {"reference": ref, "target_fraction": fraction, "target_loss": target, "no_exchange_ms":
            {t["link"]: t["ms_per_step"] for t in timing if t["mode"] == "none"}, "rows": rows}


def format_table(result: dict) -> str:
    lines = [f"target: held-out loss {result['target_loss']:.4f} nats/byte ({result['reference']} at "
             f"{result['target_fraction']:.0%} of its run)"]
    for link in dict.fromkeys(r["link"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["link"] == link]
        reached = [r["seconds_to_target"] for r in rows if r["seconds_to_target"] is not None]
        best = min(reached) if reached else None
        none = result["no_exchange_ms"].get(link)
        lines += ["", f"## {link} between nodes (no exchange: {none:.1f} ms per step)" if none else f"## {link}",
                  "| mode | ms / step | inter-node MB / step / node | steps to target | s to target | x fastest |"
                  " final loss |", "|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["seconds_to_target"] is None, r["seconds_to_target"] or 0)):
            s, st = r["seconds_to_target"], r["steps_to_target"]
            lines.append(f"| {r['mode']} | {r['ms_per_step']:.1f} | {r['inter_node_mb_per_step_per_node']:.4f} | "
                         f"{'not reached' if st is None else f'{st:.0f}'} | {'–' if s is None else f'{s:.1f}'} | "
                         f"{'–' if s is None else f'{s / best:.2f}'} | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def plot(result: dict, curves: Dict[str, dict], path: Path, link: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in (r for r in result["rows"] if r["link"] == link):
        c = curves[r["quality_run"]]
        xs = [seconds_at(p["step"], r["ms_per_step"], r["dense_ms_charged"],
                         **{k: r[k] for k in ("dense_steps", "refresh_steps", "density_warmup") if k in r})
              for p in c["curve"]]
        ax.plot(xs, [p["loss"] for p in c["curve"]], label=r["mode"], lw=2.2 if "dragonn" in r["mode"] else 1.2)
    ax.axhline(result["target_loss"], color="black", ls="--", lw=0.8, label="target")
    ax.set(xlabel=f"seconds ({link} between nodes)", ylabel="held-out loss (nats/byte)", xscale="log",
           title="LM, 2 nodes x 2 ranks: held-out loss against wall-clock")
    ax.set_ylim(result["target_loss"] * 0.95, result["target_loss"] * 1.6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def _load(p: argparse.ArgumentParser, path: str, key: str, what: str) -> list:
    """The ``key`` list of the JSON file ``path``; an argparse error names the file when it is not one."""
    try:
        return json.loads(Path(path).read_text())[key]
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"{path}: not {what} (a JSON object with '{key}'): {e!r}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quality", nargs="+", required=True, help="convergence.py records (convergence.json)")
    p.add_argument("--timing", nargs="+", required=True, help="bench_nodes.py --task lm records (nodes_lm.json)")
    p.add_argument("--out", required=True, help="ttq_nodes.json and ttq_nodes.png go here")
    p.add_argument("--target-fraction", type=float, default=TARGET_FRACTION,
                   help=f"the target is the reference's held-out loss at this fraction of its run (default {TARGET_FRACTION})")
    p.add_argument("--plot-link", default="100mbit", help="the link whose seconds the PNG's x axis shows (default 100mbit)")
    a = p.parse_args(argv)
    if not 0.0 < a.target_fraction <= 1.0:
        p.error(f"--target-fraction must be in (0, 1], got {a.target_fraction}")
    records = [r for f in a.quality for r in _load(p, f, "records", "launch/convergence.py's convergence.json")]
    timing = [r for f in a.timing for r in _load(p, f, "rows", "launch/bench_nodes.py --task lm's nodes_lm.json")]
    curves = mean_curves(records)
    result = build_rows(curves, timing, a.target_fraction)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "ttq_nodes.json", {**result, "quality": a.quality, "timing": a.timing}, indent=1)
    plot(result, curves, out / "ttq_nodes.png", a.plot_link)
    print(format_table(result))
    print(f"wrote {out}/ttq_nodes.json, ttq_nodes.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
