#!/usr/bin/env bash
# World-size scaling benchmark of the exchange schemes (allgather vs partitioned) at 2, 4 and 8 local ranks,
# on the link benchmark's real 24.2 M-parameter gradient: prints the table and writes docs/bench_scaling.{txt,json,png}.
#   bash launch/bench_scaling.sh                              # defaults: --world-sizes 2,4,8 --densities 0.01,0.001
#   bash launch/bench_scaling.sh --world-sizes 2,4 --steps 2  # any option of launch/bench_scaling.py
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$REPO/launch/setup_env.sh"
mkdir -p "$REPO/docs"
python "$REPO/launch/bench_scaling.py" --json "$REPO/docs/bench_scaling.json" --plot "$REPO/docs/bench_scaling.png" "$@" \
  | tee "$REPO/docs/bench_scaling.txt"
