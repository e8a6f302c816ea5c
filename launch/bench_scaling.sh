#!/usr/bin/env bash
# World-size scaling benchmark of the exchange schemes (allgather vs partitioned) at 2, 4 and 8 local ranks,
# on the link benchmark's real 24.2 M-parameter gradient: prints the table and writes OUT/bench_scaling.{txt,json,png}.
#   bash launch/bench_scaling.sh                              # defaults: --world-sizes 2,4,8 --densities 0.01,0.001
#   bash launch/bench_scaling.sh --world-sizes 2,4 --steps 2  # any option of launch/bench_scaling.py
#   OUT=docs bash launch/bench_scaling.sh                     # how the committed docs/bench_scaling.* were made
#   OUT (default runs/bench_scaling)  where the table, JSON and PNG go
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$REPO/launch/setup_env.sh"
OUT="${OUT:-$REPO/runs/bench_scaling}"
mkdir -p "$OUT"
python "$REPO/launch/bench_scaling.py" --json "$OUT/bench_scaling.json" --plot "$OUT/bench_scaling.png" "$@" \
  | tee "$OUT/bench_scaling.txt"
