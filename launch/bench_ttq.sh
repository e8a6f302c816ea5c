#!/usr/bin/env bash
# Time-to-target benchmark (launch/bench_ttq.py): the quality phase (every mode's full run, unthrottled, with
# held-out evaluations), then the timing phase on each link (two ranks in two network namespaces joined by a
# veth pair throttled with tc tbf: root), then the report (a table per link, JSON, PNG).
#
#   sudo bash launch/bench_ttq.sh                       # default modes, 100mbit and 1gbit (~35-40 min on 2 quiet cores)
#   sudo bash launch/bench_ttq.sh --quick               # tiny model, 2 modes, 100mbit (~1-2 min): plumbing
#   sudo bash launch/bench_ttq.sh --skip-quality --links 1gbit   # re-time on another link, reuse the quality runs
#   bash launch/bench_ttq.sh --quality-only              # no root needed: quality phase and report
#
# Options (anything else, e.g. --modes "ds_fp32 dragonn", --mode NAME=JSON, --steps N, --time-steps N,
# --eval-every N, goes to every phase of launch/bench_ttq.py; see python launch/bench_ttq.py quality -h):
#   --links "L ..."   tc rates (100mbit, 1gbit, ...) or unthrottled (default: 100mbit 1gbit; --quick: 100mbit)
#   --out DIR         records, logs, JSON, PNG (default: runs/bench_ttq)
#   --json PATH       the report's JSON (default: OUT/bench_ttq.json)
#   --plot PATH       the report's PNG (default: OUT/bench_ttq.png)
#   --quick           passed on (tiny model and runs), and --links defaults to 100mbit
#   --skip-quality    keep OUT's quality records (run only the timing phase and the report)
#   --quality-only    no timing phase (no root needed)
# One link benchmark at a time (bench_link.sh and this share a lock): a second one exits 75 at once. The
# namespaces are deleted on exit, also on failure or Ctrl-C, and leftovers of a crashed run at start. A failed
# run is reported and skipped; the script then exits 1 after the report of what succeeded.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINKS="" OUT="$REPO/runs/bench_ttq" JSON="" PLOT="" QUICK=0 SKIP_QUALITY=0 QUALITY_ONLY=0 EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --links) LINKS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --json) JSON="$2"; shift 2 ;;
    --plot) PLOT="$2"; shift 2 ;;
    --quick) QUICK=1; EXTRA+=(--quick); shift ;;
    --skip-quality) SKIP_QUALITY=1; shift ;;
    --quality-only) QUALITY_ONLY=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
if [[ -z "$LINKS" ]]; then
  if [[ "$QUICK" == 1 ]]; then LINKS="100mbit"; else LINKS="100mbit 1gbit"; fi
fi
if [[ "$QUALITY_ONLY" == 1 && "$SKIP_QUALITY" == 1 ]]; then
  echo "bench_ttq.sh: --quality-only and --skip-quality leave nothing to run" >&2
  exit 2
fi
OUT="$(realpath -m "$OUT")"  # relative to the caller's directory
REPORT_ARGS=(--out "$OUT")
[[ -z "$JSON" ]] || REPORT_ARGS+=(--json "$(realpath -m "$JSON")")
[[ -z "$PLOT" ]] || REPORT_ARGS+=(--plot "$(realpath -m "$PLOT")")
ROOT=0
[[ "$(id -u)" != 0 ]] || ROOT=1
if [[ "$ROOT" == 0 && "$QUALITY_ONLY" == 0 ]]; then
  echo "bench_ttq.sh: the timing phase needs root (network namespaces, tc): run it with sudo, or pass" \
       "--quality-only" >&2
  exit 1
fi
# shellcheck disable=SC1091
. "$REPO/launch/setup_env.sh"
cd "$REPO"
# shellcheck source=launch/netns.sh
. "$REPO/launch/netns.sh"
NS=(dragonn_tq0 dragonn_tq1)              # one namespace per rank
IF=(tqveth0 tqveth1)                      # the veth end in each
ADDR=(198.51.100.11 198.51.100.12)        # documentation range, exists only inside the namespaces

[[ "$ROOT" == 1 ]] || BENCH_LOCK="${TMPDIR:-/tmp}/ds_dragonn_bench_link.lock"  # /run is root's
if ! bench_lock; then
  echo "bench_ttq.sh: another link benchmark (bench_link.sh or bench_ttq.sh) is running" >&2
  exit 75
fi

PY_PID=""
cleanup() {
  if [[ -n "$PY_PID" ]]; then kill "$PY_PID" 2>/dev/null || true; wait "$PY_PID" 2>/dev/null || true; fi
  if [[ "$ROOT" == 1 ]]; then netns_down; remove_all_shm; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# the driver runs in the background so that a signal reaches the traps at once; it kills its ranks on SIGTERM
py() {
  local rc=0
  python launch/bench_ttq.py "$@" &
  PY_PID=$!
  wait "$PY_PID" || rc=$?
  PY_PID=""
  return "$rc"
}

FAILED=0
if [[ "$ROOT" == 1 ]]; then netns_down; remove_all_shm; fi
if [[ "$SKIP_QUALITY" == 0 ]]; then
  rm -rf "$OUT/records"
  echo "==== quality phase (unthrottled)"
  py quality --out "$OUT" "${EXTRA[@]}" || FAILED=1
else
  rm -rf "$OUT/records/timing"
fi
if [[ "$QUALITY_ONLY" == 0 ]]; then
  for link in $LINKS; do
    echo "==== timing phase @ $link"
    netns_up "$link"
    py timing --out "$OUT" --link "$link" --netns "${NS[*]}" --ifaces "${IF[*]}" --master-addr "${ADDR[0]}" \
      "${EXTRA[@]}" || FAILED=1
    netns_down
  done
fi
echo "==== report"
py report "${REPORT_ARGS[@]}" "${EXTRA[@]}" || FAILED=1
exit "$FAILED"
