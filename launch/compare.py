"""Compare the main job's dense and DRAGONN summaries: a table, and the two acceptance checks
(accuracy within 1 percentage point of dense, bytes sent <= 3 % of the dense allreduce's)."""
from __future__ import annotations

import argparse
import json

ACC_TOLERANCE_PP = 1.0  # percentage points
MAX_BYTES_RATIO = 0.03


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("dense")
    p.add_argument("dragonn")
    p.add_argument("--json", help="write the comparison here")
    a = p.parse_args()
    runs = {name: json.load(open(path)) for name, path in (("dense", a.dense), ("dragonn", a.dragonn))}
    print(f"\n{'run':<8} {'ranks':>5} {'steps':>6} {'density':>8} {'test_acc':>9} {'final_loss':>10} "
          f"{'MB sent':>9} {'MB dense-eq':>11} {'ratio':>7} {'compress ms/step':>16}")
    for name, s in runs.items():
        ratio = s["bytes_sent"] / s["dense_bytes_equivalent"]
        compress = f"{s['compress_ms_mean']:.2f}" if s.get("dragonn_enabled") else "-"
        print(f"{name:<8} {s['world_size']:>5} {s['steps']:>6} {s['density']:>8g} {s['test_accuracy']:>9.4f} "
              f"{s['final_loss']:>10.4f} {s['bytes_sent'] / 1e6:>9.3f} {s['dense_bytes_equivalent'] / 1e6:>11.3f} "
              f"{ratio:>7.4f} {compress:>16}")
    d, c = runs["dense"], runs["dragonn"]
    gap_pp = 100 * (d["test_accuracy"] - c["test_accuracy"])
    ratio = c["bytes_sent"] / c["dense_bytes_equivalent"]
    result = {"dense": d, "dragonn": c, "accuracy_gap_pp": gap_pp, "bytes_ratio": ratio,
              "accuracy_ok": gap_pp <= ACC_TOLERANCE_PP, "bytes_ok": ratio <= MAX_BYTES_RATIO}
    print("\nMB sent: bytes each rank put on the wire over the run; dense-eq: what DeepSpeed's ring allreduce "
          "would have sent")
    print(f"accuracy gap (dense - dragonn): {gap_pp:+.2f} pp (target <= {ACC_TOLERANCE_PP}) "
          f"{'OK' if result['accuracy_ok'] else 'MISSED'}")
    print(f"bytes sent / dense equivalent: {ratio:.4f} (target <= {MAX_BYTES_RATIO}) "
          f"{'OK' if result['bytes_ok'] else 'MISSED'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["accuracy_ok"] and result["bytes_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
