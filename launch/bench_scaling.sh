#!/usr/bin/env bash
# World-size scaling benchmark of the exchange schemes (allgather vs partitioned) at 2, 4 and 8 local ranks,
# on the link benchmark's real 24.2 M-parameter gradient: prints the table and writes
# OUT/exchanges_by_world_size.{txt,json,png}.
#   bash launch/bench_scaling.sh                              # defaults: --world-sizes 2,4,8 --densities 0.01,0.001
#   bash launch/bench_scaling.sh --world-sizes 2,4 --steps 2  # any option of launch/bench_scaling.py
#   OUT=docs/results/scaling bash launch/bench_scaling.sh     # how the committed results were made
#   OUT (default runs/bench_scaling)  where the table, JSON and PNG go
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$REPO/launch/setup_env.sh"
OUT="${OUT:-$REPO/runs/bench_scaling}"
mkdir -p "$OUT"
python "$REPO/launch/bench_scaling.py" --json "$OUT/exchanges_by_world_size.json" \
  --plot "$OUT/exchanges_by_world_size.png" "$@" | tee "$OUT/exchanges_by_world_size.txt"
