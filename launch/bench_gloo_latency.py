"""gloo/TCP on this host: the per-message latency and the loopback bandwidth that ``launch/bench/project.py`` takes
for the testbed (``launch/bench_nodes.py``) in place of a link setting.

P processes (default 4, as the testbed's 2 x 2 ranks) rendezvous over 127.0.0.1 with gloo, ``OMP_NUM_THREADS=1``:

* latency: the median time of one ``all_gather_into_tensor`` of 8 bytes, a ring of P - 1 rounds, over
  --repeat calls, divided by P - 1: the cost of one message round (wake-up, syscalls, loopback TCP);
* bandwidth: ranks 0 and 1 allreduce --numel fp32 elements (a 2-rank ring: 2 rounds of numel/2 elements
  each way); its median time less 2 x the pair's own round latency (an 8-byte allreduce) gives the bits per
  second of loopback TCP plus gloo's sum.

    python launch/bench_gloo_latency.py [--ranks 4] [--numel 4194304] [--repeat 200] [--json PATH]

The numbers depend on the host's load (other processes delay every wake-up): the output prints the load average.
Runs and medians used by the model: docs/results/projection/host.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench.common import free_port  # noqa: E402


def _timed(fn, repeat: int, group=None) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls, after 10 untimed ones; ranks start each call together."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeat):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, numel: int, repeat: int, queue) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor: what ds_dragonn calls
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    small, out = torch.zeros(2, dtype=torch.int32), torch.zeros(2 * world, dtype=torch.int32)
    lat = _timed(lambda: dist.all_gather_into_tensor(out, small), repeat) / (world - 1)
    pair = dist.new_group([0, 1])
    buf = torch.ones(numel)
    one = torch.ones(1)
    pair_lat = big = 0.0
    if rank < 2:
        pair_lat = _timed(lambda: dist.all_reduce(one, group=pair), repeat, pair) / 2  # 2 rounds
        big = _timed(lambda: dist.all_reduce(buf, group=pair), max(repeat // 10, 5), pair)
    if rank == 0:
        wire = numel * 4  # a 2-rank ring allreduce: each rank sends 2 x numel/2 fp32 elements
        queue.put({"ranks": world, "latency_us": lat * 1e6, "pair_latency_us": pair_lat * 1e6,
                   "allreduce_ms": big * 1e3, "numel": numel,
                   "loopback_gbit_s": wire * 8 / max(big - 2 * pair_lat, 1e-9) / 1e9, "load_avg": os.getloadavg()})
    dist.barrier()  # ranks 2.. wait for the pair's timing before the group goes
    dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="processes (>= 2)")
    p.add_argument("--numel", type=int, default=1 << 22, help="fp32 elements of the 2-rank allreduce (bandwidth)")
    p.add_argument("--repeat", type=int, default=200, help="timed calls of the latency collective")
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args(argv)
    if a.ranks < 2:
        p.error("--ranks must be at least 2")
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(a.ranks, free_port(), a.numel, a.repeat, queue), nprocs=a.ranks,
                       start_method="spawn")
    result = queue.get()
    print(json.dumps(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
