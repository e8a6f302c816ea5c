"""Compare the main job's summaries: dense against each compressed run, a table, and per compressed run the
two acceptance checks (accuracy within 1 percentage point of dense; bytes sent <= 3 % of the dense
allreduce's at 2 ranks, and for the allgather exchange, whose bytes grow with the world size P, <= 3 % × P/2).
Exit 1 when a check is missed.

    python launch/compare.py runs/main/dense.json runs/main/dragonn.json runs/main/dragonn_partitioned.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import write_json

ACC_TOLERANCE_PP = 1.0  # percentage points
MAX_BYTES_RATIO = 0.03  # at 2 ranks


def bytes_target(summary: dict) -> float:
    """The bytes-ratio target of a run: allgather sends (P−1)·k pairs against the ring's 2(P−1)/P·n, so its
    ratio grows as P/2; the partitioned exchange and ZeRO's reduce-scatter stay flat."""
    world = int(summary.get("world_size", 2))
    return MAX_BYTES_RATIO * max(1.0, world / 2) if summary.get("exchange", "allgather") == "allgather" else MAX_BYTES_RATIO


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dense", help="the dense run's --summary JSON")
    p.add_argument("compressed", nargs="*", help="compressed runs' --summary JSONs (runs are named by file stem)")
    p.add_argument("--json", help="write the comparison here")
    a = p.parse_args()
    base = Path(a.dense).stem
    runs = {base: json.load(open(a.dense))}
    runs.update({Path(path).stem: json.load(open(path)) for path in a.compressed})
    width = max(len(n) for n in runs)
    print(f"\n{'run':<{width}} {'ranks':>5} {'steps':>6} {'exchange':>14} {'density':>8} {'test_acc':>9} "
          f"{'final_loss':>10} {'MB sent':>9} {'MB dense-eq':>11} {'ratio':>7} {'compress ms/step':>16}")
    for name, s in runs.items():
        ratio = s["bytes_sent"] / s["dense_bytes_equivalent"]
        on = s.get("dragonn_enabled")
        compress = f"{s['compress_ms_mean']:.2f}" if on else "-"
        print(f"{name:<{width}} {s['world_size']:>5} {s['steps']:>6} {s.get('exchange', '-') if on else '-':>14} "
              f"{s['density']:>8g} {s['test_accuracy']:>9.4f} {s['final_loss']:>10.4f} {s['bytes_sent'] / 1e6:>9.3f} "
              f"{s['dense_bytes_equivalent'] / 1e6:>11.3f} {ratio:>7.4f} {compress:>16}")
    print("\nMB sent: gradient bytes each rank put on the wire over the run; dense-eq: what the dense collective "
          "replaced would have sent (a ring allreduce; for ZeRO 1/2 a ring reduce-scatter, half of DeepSpeed's "
          "default allreduce; ZeRO's parameter all-gather is not counted)")
    d = runs[base]
    result = {"baseline": base, "dense": d, "runs": {}}
    ok = True
    for name, c in list(runs.items())[1:]:
        gap_pp = 100 * (d["test_accuracy"] - c["test_accuracy"])  # vs the first (baseline) run
        ratio = c["bytes_sent"] / c["dense_bytes_equivalent"]
        r = {"summary": c, "accuracy_gap_pp": gap_pp, "bytes_ratio": ratio,
             "accuracy_ok": gap_pp <= ACC_TOLERANCE_PP, "bytes_target": bytes_target(c),
             "bytes_ok": ratio <= bytes_target(c)}
        result["runs"][name] = r
        ok = ok and r["accuracy_ok"] and r["bytes_ok"]
        print(f"{name}: accuracy gap ({base} - {name}) {gap_pp:+.2f} pp (target <= {ACC_TOLERANCE_PP}) "
              f"{'OK' if r['accuracy_ok'] else 'MISSED'}; bytes sent / dense equivalent {ratio:.4f} "
              f"(target <= {r['bytes_target']:g}) {'OK' if r['bytes_ok'] else 'MISSED'}")
    if a.json:
        write_json(a.json, result)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
