#!/usr/bin/env bash
# Two network namespaces joined by a veth pair, throttled with tc's tbf: the slow link of the link benchmarks
# (bench_link.sh, bench_ttq.sh). Sourced, not run. The caller sets, before calling these functions:
#   NS=(ns0 ns1)      one namespace per rank
#   IF=(if0 if1)      the veth end in each
#   ADDR=(a0 a1)      their addresses, from 198.51.100.0/24 (a documentation range): they exist only inside
#                     the namespaces, so rank traffic never leaves this machine
# Needs root (ip netns, tc).

# one link benchmark at a time: a second one would delete the first one's namespaces or skew its timings.
# Returns 1 when another holds the lock (the caller says so and exits).
BENCH_LOCK=/run/ds_dragonn_bench_link.lock
bench_lock() {
  exec 9>"$BENCH_LOCK"
  flock -n 9
}

netns_down() { for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done; }

netns_up() {  # link: a tc rate (100mbit, 1gbit, ...) or unthrottled
  netns_down
  ip netns add "${NS[0]}"
  ip netns add "${NS[1]}"
  ip link add "${IF[0]}" netns "${NS[0]}" type veth peer name "${IF[1]}" netns "${NS[1]}"
  for i in 0 1; do
    ip -n "${NS[i]}" addr add "${ADDR[i]}/24" dev "${IF[i]}"
    ip -n "${NS[i]}" link set lo up
    ip -n "${NS[i]}" link set "${IF[i]}" up
    if [[ "$1" != unthrottled ]]; then
      tc -n "${NS[i]}" qdisc add dev "${IF[i]}" root tbf rate "$1" burst 1mbit latency 400ms
    fi
  done
}

# DeepSpeed's CPU shm allreduce leaves /dev/shm/deepspeed_allreduce_buffer_*_<addr>_<port>_<rank> behind
# (never unlinked); the ranks set LOCAL_SIZE=1 so that it should not start, and any file of ours is removed.
remove_shm() { for p in "$@"; do rm -f /dev/shm/deepspeed_allreduce_buffer_*_"${ADDR[0]}_${p}"_*; done; }

# a crashed earlier run's files (the address is ours only)
remove_all_shm() { rm -f /dev/shm/deepspeed_allreduce_buffer_*_"${ADDR[0]}"_*; }
