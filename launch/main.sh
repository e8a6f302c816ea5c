#!/usr/bin/env bash
# The main job: set-up (first run only), then the same training run with the deepspeed launcher for each
# config: dense allreduce, DRAGONN (allgather exchange), DRAGONN with the partitioned exchange; then a
# side-by-side comparison. Extra arguments go to launch/train.py.
#   NUM_RANKS (default 2)   ranks on this host
#   RUNS (default "dense dragonn dragonn_partitioned")  configs/<name>.json to run; the first is the baseline
#   OUT (default runs/main) where the summaries and comparison.json go
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$REPO/launch/setup_env.sh"
cd "$REPO"
OUT="${OUT:-runs/main}"
NUM_RANKS="${NUM_RANKS:-2}"
read -r -a runs <<< "${RUNS:-dense dragonn dragonn_partitioned}"
mkdir -p "$OUT"
# DeepSpeed's CPU shared-memory allreduce leaves a 69 MB /dev/shm file per rank and port behind
# (deepspeed_allreduce_buffer_*_<addr>_<port>_<rank>, never unlinked): remove ours when the job ends.
ports=()
cleanup_shm() { for p in "${ports[@]}"; do rm -f /dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_"$p"_*; done; }
trap cleanup_shm EXIT
for name in "${runs[@]}"; do
  port="$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  ports+=("$port")
  echo "== $name: deepspeed --num_gpus $NUM_RANKS launch/train.py --deepspeed_config configs/$name.json"
  deepspeed --num_gpus "$NUM_RANKS" --master_addr 127.0.0.1 --master_port "$port" \
    launch/train.py --deepspeed_config "configs/$name.json" --summary "$OUT/$name.json" "$@" 2>&1 \
    | grep -v -E "^\[[0-9-]+ [0-9:,]+\] \[(INFO|WARNING)\]|FutureWarning|return func\(\*args"
done
summaries=()
for name in "${runs[@]}"; do summaries+=("$OUT/$name.json"); done
python launch/compare.py "${summaries[@]}" --json "$OUT/comparison.json"
