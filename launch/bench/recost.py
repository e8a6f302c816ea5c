"""Time to target of new quality runs at the step times of an earlier, committed ``bench_ttq.py`` report.

A mode that sends the same bytes per step as a timed one (e.g. the unsent Δ kept in the weights against the earlier restart from θ_outer: the same
density, exchange and H) has that mode's step time; only its steps to the target differ. This script takes the
committed report's rows (``report`` JSON: target, every mode's curve and per-link step times), adds the new quality
records of ``bench_ttq.py quality --out DIR`` with the step times of the mode each borrows from, and prints the
table, writes JSON and a PNG (held-out loss against seconds at ``--plot-link``).

    python launch/bench/recost.py docs/results/local_steps/lm_2000steps.json runs/ttq_kept \
        --timing-from kept_h30_d0.01=local_h30_d0.01 --out docs/results/local_steps/kept/gpt_2000steps

Raises SystemExit naming the file or mode that is missing or does not match (steps, target).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import format_table, pyplot, save_figure, write_json  # noqa: E402
from bench_ttq import seconds_at, steps_to_target  # noqa: E402


def _pairs(items) -> dict:
    out = {}
    for item in items:
        new, sep, old = item.partition("=")
        if not sep or not new or not old:
            raise SystemExit(f"--timing-from wants NEW=OLD (a new mode and a committed timed mode), got {item!r}")
        out[new] = old
    return out


def recost(committed: dict, quality: list, timing_from: dict, keep: list) -> list:
    """Rows: the committed rows of the modes in ``keep`` and, per link, one row per new quality record."""
    rows = committed["records"]
    links = sorted({r["link"] for r in rows if r["link"]}, key=lambda l: next(r["link_mbit"] for r in rows
                                                                                if r["link"] == l))
    target = rows[0]["target_loss"]
    out = [dict(r, source="committed") for r in rows if r["mode"] in keep]
    for q in quality:
        src = timing_from.get(q["mode"])
        if src is None:
            raise SystemExit(f"no --timing-from for the new mode {q['mode']!r}")
        if q["steps"] != rows[0]["steps"]:
            raise SystemExit(f"{q['mode']}: {q['steps']} steps, the committed report {rows[0]['steps']}")
        reach = steps_to_target(q["curve"], target)
        for link in links:
            t = next((r for r in rows if r["mode"] == src and r["link"] == link), None)
            if t is None or not t.get("median_step_ms"):
                raise SystemExit(f"the committed report has no step time of {src!r} at {link}")
            ms, dense_ms, warm = t["median_step_ms"], t["dense_step_ms"], q.get("dense_warmup_steps", 0)
            out.append({"mode": q["mode"], "link": link, "link_mbit": t["link_mbit"], "source": "new",
                        "timing_from": src, "target_loss": target, "steps_to_target": reach,
                        "median_step_ms": ms, "dense_step_ms": dense_ms, "dense_warmup_steps": warm,
                        "time_to_target_s": seconds_at(reach, ms, dense_ms, warm) if reach is not None else None,
                        "final_loss": q["final_loss"],
                        "final_gap_to_target_pct": None if reach is not None else
                        100 * (q["final_loss"] - target) / target,
                        "bytes_per_step": t["bytes_per_step"], "steps": q["steps"], "about": q.get("about", ""),
                        "curve": [dict(c, seconds=seconds_at(c["step"], ms, dense_ms, warm)) for c in q["curve"]]})
    return out


def table(rows: list, link: str) -> str:
    body = []
    mine = sorted((r for r in rows if r["link"] == link),
                  key=lambda r: (r["time_to_target_s"] is None, r["time_to_target_s"] or 0, r["final_loss"]))
    for r in mine:
        reach = (f"{r['steps_to_target']:.0f}" if r["steps_to_target"] is not None else
                 f"not reached ({r['final_gap_to_target_pct']:+.1f} %)")
        tt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        body.append([r["mode"] + (f" (timing of {r['timing_from']})" if r.get("timing_from") else ""),
                     r["source"], reach, f"{r['median_step_ms']:.1f}" if r["median_step_ms"] else "-", tt,
                     f"{r['final_loss']:.4f}", f"{r['bytes_per_step'] / 1e6:.4f}"])
    return format_table(["mode", "record", "steps to target", "ms/step", "time to target (s)", "final loss",
                         "MB/step"], body)


def plot(rows: list, link: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["link"] == link and r.get("curve") and r["curve"][0].get("seconds") is not None:
            ax.plot([c["seconds"] for c in r["curve"]], [c["loss"] for c in r["curve"]], label=r["mode"])
    target = next(r["target_loss"] for r in rows)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.4f}")
    ax.set_xlabel(f"seconds at {link}")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_ylim(target * 0.95, target * 1.6)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="the committed bench_ttq report JSON (its 'records' rows)")
    p.add_argument("out_dir", type=Path, help="a bench_ttq --out folder with new records/quality/*.json")
    p.add_argument("--timing-from", nargs="+", required=True, metavar="NEW=OLD",
                   help="each new mode and the committed timed mode whose step times it takes")
    p.add_argument("--keep", default="ds_bf16,ds_fp32,dragonn,diloco_h30,local_h30_d0.01,none",
                   help="committed modes shown alongside (comma-separated)")
    p.add_argument("--plot-link", default="100mbit")
    p.add_argument("--out", type=Path, required=True, help="output prefix (writes .json, .txt, .png)")
    a = p.parse_args(argv)
    try:
        committed = json.loads(a.report.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"cannot read the committed report {a.report}: {err}")
    files = sorted((a.out_dir / "records" / "quality").glob("*.json"))
    if not files:
        raise SystemExit(f"no quality records under {a.out_dir / 'records' / 'quality'}")
    quality = [json.loads(f.read_text()) for f in files]
    rows = recost(committed, quality, _pairs(a.timing_from), a.keep.split(","))
    links = sorted({r["link"] for r in rows}, key=lambda l: next(r["link_mbit"] for r in rows if r["link"] == l))
    text = "\n\n".join(f"== link {link}\n{table(rows, link)}" for link in links)
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{a.out}.txt").write_text(text + "\n")
    write_json(f"{a.out}.json", {"method": "steps to target from the new quality runs; step times from the "
                                           f"committed report {a.report} (timing_from)", "records": rows})
    plot(rows, a.plot_link, Path(f"{a.out}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
