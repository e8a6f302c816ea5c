#!/usr/bin/env bash
# Link benchmark (root): every mode of launch/bench_link.py on every link, two ranks in two network namespaces
# joined by a veth pair and throttled with tc's tbf on both ends, then one table, JSON and bar chart.
#
#   sudo bash launch/bench_link.sh                                   # all modes, 1gbit 10gbit unthrottled
#   sudo bash launch/bench_link.sh --links "1gbit unthrottled" --modes "none ds_dense_fp32 dragonn" --steps 60
#   sudo bash launch/bench_link.sh --add --modes dragonn --mode-name dragonn_always --dragonn '{"policy": "always"}'
#
# Options (anything else, e.g. --warmup-steps 3 --eval-every 5 --dragonn JSON, goes to launch/bench_link.py):
#   --links "L ..."   tc rates (1gbit, 500mbit, ...) or unthrottled (default: 1gbit 10gbit unthrottled)
#   --modes "M ..."   modes of bench_link.py (default: all)
#   --steps N         training steps per run, warm-up included (default: bench_link.py's)
#   --out DIR         records and per-rank logs (default: runs/bench_link)
#   --json PATH       the report's records (default: OUT/link.json)
#   --plot PATH       the report's bar chart (default: OUT/link.png)
#   --timeout S       wall-clock limit of one run (default: 1800 s); a run past it is killed and counted failed
#   --add             keep earlier records in OUT/records (to add rows, e.g. a --mode-name variant)
#   --mode-name NAME  the row's label (one mode only), passed on; also names the run's logs
# The rank traffic stays inside the namespaces (198.51.100.0/24); the namespaces are deleted on exit, also
# on failure or Ctrl-C, and leftovers of a crashed run at start. A failed run is reported and skipped; the
# script then exits 1 after the report of the runs that succeeded.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINKS="1gbit 10gbit unthrottled"
MODES="none ds_dense_fp32 ds_dense_bf16 dragonn ddp_powersgd_r1 ddp_powersgd_r4 ddp_bf16 dgc ds_zero2_dense dragonn_zero2"
OUT="$REPO/runs/bench_link" JSON="" PLOT="" RUN_TIMEOUT=1800 ADD=0 LABEL="" EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --links) LINKS="$2"; shift 2 ;;
    --modes) MODES="$2"; shift 2 ;;
    --steps) EXTRA+=(--steps "$2"); shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --json) JSON="$2"; shift 2 ;;
    --plot) PLOT="$2"; shift 2 ;;
    --timeout) RUN_TIMEOUT="$2"; shift 2 ;;
    --add) ADD=1; shift ;;
    --mode-name) LABEL="$2"; EXTRA+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
OUT="$(realpath -m "$OUT")" JSON="$(realpath -m "${JSON:-$OUT/link.json}")" \
  PLOT="$(realpath -m "${PLOT:-$OUT/link.png}")"  # relative to the caller's directory
if [[ "$(id -u)" != 0 ]]; then
  echo "bench_link.sh: needs root (it creates network namespaces and tc qdiscs): run it with sudo" >&2
  exit 1
fi
# shellcheck disable=SC1091
. "$REPO/launch/setup_env.sh"
cd "$REPO"

# shellcheck source=launch/netns.sh
. "$REPO/launch/netns.sh"               # netns_up/netns_down, bench_lock, remove_shm (shared with bench_ttq.sh)
NS=(dragonn_bl0 dragonn_bl1)            # one namespace per rank
IF=(blveth0 blveth1)                    # the veth end in each
ADDR=(198.51.100.1 198.51.100.2)        # documentation range, exists only inside the namespaces
BASE_PORT=29600                         # MASTER_PORT of the first run, +1 per run
PIDS=() PORTS=() FAILED=()

# one link benchmark at a time: a second one would delete this one's namespaces
bench_lock || { echo "bench_link.sh: another link benchmark (bench_link.sh or bench_ttq.sh) is running" >&2; exit 1; }

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  netns_down
  remove_shm "${PORTS[@]}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

run_pair() {  # mode link log-prefix -> 0 when both ranks succeed
  local mode="$1" link="$2" log="$3" port=$((BASE_PORT + ${#PORTS[@]})) rc=0 done_pid r s
  PORTS+=("$port")
  PIDS=()
  for r in 0 1; do
    timeout -k 10 "$RUN_TIMEOUT" ip netns exec "${NS[r]}" env RANK="$r" WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_SIZE=1 \
      MASTER_ADDR="${ADDR[0]}" MASTER_PORT="$port" GLOO_SOCKET_IFNAME="${IF[r]}" \
      python launch/bench_link.py --mode "$mode" --link "$link" --iface "${IF[r]}" --record-dir "$OUT/records" \
      "${EXTRA[@]}" > "$log.rank$r.log" 2>&1 &
    PIDS+=($!)
  done
  # the first rank to fail would leave its peer blocked in a collective: stop the peer then
  wait -n -p done_pid "${PIDS[@]}" || { rc=$?; kill "${PIDS[@]}" 2>/dev/null || true; }
  for r in 0 1; do
    if [[ "${PIDS[r]}" != "$done_pid" ]]; then wait "${PIDS[r]}" || { s=$?; [[ "$rc" != 0 ]] || rc=$s; }; fi
  done
  PIDS=()
  remove_shm "$port"
  return "$rc"
}

netns_down
remove_all_shm  # a crashed earlier run's (the address is ours only)
if [[ "$ADD" == 0 ]]; then rm -rf "$OUT/records"; fi
mkdir -p "$OUT/records" "$OUT/logs"
for link in $LINKS; do
  netns_up "$link"
  for mode in $MODES; do
    echo "== ${LABEL:-$mode} @ $link"
    log="$OUT/logs/${LABEL:-$mode}@$link"
    start=$SECONDS
    if run_pair "$mode" "$link" "$log"; then
      grep -h '^record ' "$log.rank0.log" || true
      echo "   ($((SECONDS - start)) s)"
    else
      rc=$?
      FAILED+=("${LABEL:-$mode}@$link")
      echo "!! ${LABEL:-$mode} @ $link failed (exit $rc; 124 or 137: past --timeout ${RUN_TIMEOUT}s); its logs end:" >&2
      tail -n 15 "$log".rank*.log >&2
    fi
  done
  netns_down
done

shopt -s nullglob
records=("$OUT"/records/*.json)
if [[ ${#records[@]} -gt 0 ]]; then
  python launch/bench_link.py --report "${records[@]}" --json "$JSON" --plot "$PLOT"
fi
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "failed runs: ${FAILED[*]} (logs in $OUT/logs)" >&2
  exit 1
fi
