"""Two-node benchmark (root): flat against node-aware exchanges across a throttled link between two nodes.

Two network namespaces are two nodes; each runs the ``deepspeed`` launcher in its multi-node mode without ssh
(``--hostfile H --no_ssh --node_rank i``) with 2 ranks that talk over the namespace's own loopback. A veth
pair throttled with tc's tbf joins the nodes: only inter-node traffic crosses it, and its own counters
(``/sys/class/net/IF/statistics/tx_bytes`` inside each namespace) count it, independently of our telemetry.
Addresses come from 198.51.100.0/24 and exist only inside the namespaces, which are deleted on exit.

The workload (``--task``) is the main job's classifier (``launch/train.py``: real digits, a 166 k-parameter MLP,
one gradient bucket) or the LM (``launch/train_lm.py``, the smaller ByteGPT of ``convergence.py --quick``, whose
time to target ``launch/bench_nodes_ttq.py`` reports from these step times and 2 x 2 quality runs), 2 x 2 ranks
on this machine's cores. Each mode runs twice, for ``--steps`` S1 and S2
steps; per step means (S2 − S1)'s difference over S2 − S1 steps, so start-up traffic and time cancel:

    none             no inter-node exchange: each node trains as its own 2-rank job (dense fp32 inside)
    dense_fp32       DeepSpeed's flat dense allreduce, fp32
    dense_bf16       the same with "communication_data_type": "bf16"
    hier_bf16        a dense allreduce node by node: fp32 inside, bf16 shards across (launch/bench/hier_dense.py)
    dragonn_flat     DRAGONN at density 0.01, every rank exchanges with every rank ("hierarchy": "flat")
    dragonn_node     DRAGONN, dense inside the node, one shard per rank across ("hierarchy": "node")
    part_flat        dragonn_flat with "exchange": "partitioned"
    part_node        dragonn_node with "exchange": "partitioned"
    zero2_flat       dragonn_flat at ZeRO 2 (the sparse reduce-scatter to ZeRO's partitions)
    zero2_node       dragonn_node at ZeRO 2 (owners take their slices of the node's result)
    zero3_dense      DeepSpeed's ZeRO 3, dense (gradient reduce-scatter and parameter all-gathers across nodes)
    zero3_hpz_dense  ZeRO 3 with hpZ ("zero_hpz_partition_size": 2: the parameter all-gathers stay in the node)
    zero3_hpz_dragonn  the same with DRAGONN's compressed gradient reduce-scatter (flat)
    diloco_flat      uncompressed DiLoCo: local steps, a dense outer step every 10 (LM: 30) steps, every rank a worker
    diloco_node      the same, each node one worker (dense allreduce inside the node every step)

    sudo python launch/bench_nodes.py --links "100mbit 1gbit" --out docs/results/nodes

prints a table and writes nodes.json and nodes.png (``--task lm``: nodes_lm.*) under --out. On 2 cores the 4 ranks share 2 cores:
step times are dominated by compute contention; compare each mode with ``none`` of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # launch/bench, beside this script
from bench import link as netlink  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
#: local steps (uncompressed DiLoCo): an outer step every TASKS' local steps (classifier 10: a 40-step
#: difference holds 4; LM 30, as its quality runs: a 60-step difference holds 2)
_DILOCO = {"sync": "local_steps", "density": 1.0, "warmup_steps": 0}
NS = ("dragonn_nodeA", "dragonn_nodeB")
IF = ("nveth0", "nveth1")
ADDR = ("198.51.100.21", "198.51.100.22")

#: mode -> (DeepSpeed config overrides, "dragonn" overrides or None for no DRAGONN, extra train.py arguments)
MODES = {
    "none": ({}, None, []),
    "dense_fp32": ({}, None, []),
    "dense_bf16": ({"communication_data_type": "bf16"}, None, []),
    "hier_bf16": ({}, None, ["--hier-dense", "bf16"]),
    "dragonn_flat": ({}, {"hierarchy": "flat"}, []),
    "dragonn_node": ({}, {"hierarchy": "node"}, []),
    "part_flat": ({}, {"hierarchy": "flat", "exchange": "partitioned"}, []),
    "part_node": ({}, {"hierarchy": "node", "exchange": "partitioned"}, []),
    "zero2_flat": ({"zero_optimization": {"stage": 2}}, {"hierarchy": "flat"}, []),
    "zero2_node": ({"zero_optimization": {"stage": 2}}, {"hierarchy": "node"}, []),
    "zero3_dense": ({"zero_optimization": {"stage": 3}}, None, []),
    "zero3_hpz_dense": ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, None, []),
    "zero3_hpz_dragonn": ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, {"hierarchy": "flat"}, []),
    "diloco_flat": ({}, {**_DILOCO, "hierarchy": "flat"}, []),
    "diloco_node": ({}, {**_DILOCO, "hierarchy": "node"}, []),
}


def netns_down() -> None:
    netlink.netns_down(NS, IF, ADDR)


def netns_up(rate: str) -> None:
    """Two namespaces joined by a veth pair, both ends throttled to ``rate`` (or unthrottled)."""
    netlink.netns_up(rate, NS, IF, ADDR)


def tx_bytes(i: int) -> int:
    """Bytes node ``i`` sent on the inter-node link (the veth's own counter, read inside its namespace)."""
    return netlink.tx_bytes(IF[i], netns=NS[i])


#: task -> (script, config, its extra arguments, DeepSpeed keys every mode adds, "dragonn" keys every DRAGONN mode
#: adds, local steps of the DiLoCo modes, default --steps). The LM (the smaller ByteGPT of ``convergence.py
#: --quick``, bf16) times the steady state of each mode its quality runs train: no dense or density warm-up (the
#: time-to-target report charges those from the quality runs), ``compress`` auto (the momentum mode, as there),
#: the dense modes on an explicit wire dtype (a bf16 engine's default wire is bf16), DiLoCo every 30 steps.
#: LM at ZeRO 3: every parameter partitioned and gathered for the forward and again for the backward, as in a
#: model too large for one rank (DeepSpeed's defaults keep parameters under 1e5 elements whole on every rank, which
#: is all of this LM's, and never release a gathered one before its reuse: hpZ would then have nothing to keep
#: inside the node). The arithmetic is unchanged: the quality runs keep the defaults.
ZERO3_GATHERS = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
TASKS = {
    "classifier": ("launch/train.py", "configs/dragonn.json", [], {}, {}, 10, "20 60"),
    "lm": ("launch/train_lm.py", "configs/lm_dragonn.json",
           ["--n-layer", "2", "--d-model", "64", "--n-head", "2", "--ctx", "32", "--eval-windows", "64"],
           {"communication_data_type": "fp32"}, {"warmup_steps": 0, "density_warmup_steps": 0}, 30, "30 90"),
}


def config(mode: str, out: Path, task: str = "classifier") -> Path:
    """The DeepSpeed config of ``mode`` on ``task``, written under ``out``."""
    _, path, _, ds_all, dragonn_all, local, _ = TASKS[task]
    cfg = json.loads((REPO / path).read_text())
    cfg.pop("communication_data_type", None)
    ds, dragonn, _ = MODES[mode]
    ds = {**ds_all, **ds}  # (a mode's own wire dtype wins)
    if dragonn is None:
        cfg.pop("dragonn")
    else:
        dragonn = {**dragonn, **({"local_steps": local} if dragonn.get("sync") == "local_steps" else {})}
        base = {k: cfg["dragonn"][k] for k in ("enabled", "density", "log_interval")}
        cfg["dragonn"] = {**(base if dragonn.get("sync") == "local_steps" else cfg["dragonn"]), **dragonn_all,
                          **dragonn}
    for key, value in ds.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    if task == "lm" and cfg.get("zero_optimization", {}).get("stage", 0) == 3:
        cfg["zero_optimization"].update(ZERO3_GATHERS)
    if cfg.get("zero_optimization", {}).get("stage", 0) == 3 or dragonn is not None:
        cfg.pop("communication_data_type", None)  # ZeRO 3 and DRAGONN: the engine's own wire dtype
    if "total_num_steps" in cfg.get("scheduler", {}).get("params", {}):
        cfg["scheduler"]["params"]["total_num_steps"] = 1000  # the quality runs' schedule
    path = out / f"{task}_{mode}.json"
    path.write_text(json.dumps(cfg))
    return path


def run(mode: str, steps: int, out: Path, port: int, timeout: int, task: str = "classifier") -> dict:
    """One run of ``mode`` for ``steps`` steps on both nodes; its summary (rank 0 of node A), wall seconds of the
    training loop, and the bytes each node put on the link."""
    script, _, task_args = TASKS[task][:3]
    cfg = config("dense_fp32" if mode == "none" else mode, out, task)
    (out / "hostfile").write_text("nodeA slots=2\nnodeB slots=2\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    before = [tx_bytes(i) for i in range(2)]
    procs, summaries = [], []
    for i in range(2):
        summary = out / f"{task}_{mode}_{steps}_node{i}.json"
        summaries.append(summary)
        if mode == "none":  # each node its own job: its own master, nothing crosses the link
            where = ["--num_gpus", "2", "--master_addr", ADDR[i], "--master_port", str(port + i)]
        else:
            where = ["--hostfile", str(out / "hostfile"), "--no_ssh", "--node_rank", str(i), "--master_addr",
                     ADDR[0], "--master_port", str(port)]
        cmd = ["ip", "netns", "exec", NS[i], "env", f"GLOO_SOCKET_IFNAME={IF[i]}", "deepspeed", *where,
               script, "--deepspeed_config", str(cfg), "--steps", str(steps), "--log-interval",
               str(steps), "--summary", str(summary), *task_args, *MODES[mode][2]]
        log = open(out / f"{task}_{mode}_{steps}_node{i}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    for p in procs:
        p.wait(timeout=timeout)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{mode} ({steps} steps) failed: see {out}/{task}_{mode}_{steps}_node*.log")
    after = [tx_bytes(i) for i in range(2)]
    s = json.loads(summaries[0].read_text())
    return {"wall_s": s["wall_s"], "tx": [a - b for a, b in zip(after, before)], "bytes_sent": s.get("bytes_sent"),
            "metric": s.get("metric", "test_accuracy"), "value": s[s.get("metric", "test_accuracy")],
            "hierarchy": s.get("hierarchy"), "in_sync": s.get("ranks_in_sync")}


def measure(links, modes, s1: int, s2: int, out: Path, timeout: int, task: str = "classifier") -> list:
    rows, port = [], 29950
    for link in links:
        netns_up(link)
        try:
            for mode in modes:
                a = run(mode, s1, out, port, timeout, task)
                b = run(mode, s2, out, port + 2, timeout, task)
                port += 4
                n = s2 - s1
                rows.append({"task": task, "link": link, "mode": mode, "ms_per_step": (b["wall_s"] - a["wall_s"]) / n * 1e3,
                             "inter_node_mb_per_step_per_node": sum(bb - aa for aa, bb in zip(a["tx"], b["tx"]))
                             / 2 / n / 1e6,
                             "telemetry_mb_per_step_per_rank": ((b["bytes_sent"] - a["bytes_sent"]) / n / 1e6
                                                                if b["bytes_sent"] is not None else None),
                             "hierarchy": b["hierarchy"], "ranks_in_sync": b["in_sync"],
                             b["metric"]: b["value"], "steps": [s1, s2]})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            netns_down()
    return rows


def report(rows: list, out: Path, task: str = "classifier") -> None:
    """Table (stdout), JSON and a bar chart of ms per step and inter-node MB per step per node."""
    print(f"{'link':>12} {'mode':>13} {'ms/step':>9} {'x none':>7} {'link MB/step/node':>18} {'telemetry MB/rank':>18}")
    for r in rows:
        none = next((x["ms_per_step"] for x in rows if x["link"] == r["link"] and x["mode"] == "none"), None)
        rel = f"{r['ms_per_step'] / none:7.2f}" if none else "      -"
        tel = r["telemetry_mb_per_step_per_rank"]
        print(f"{r['link']:>12} {r['mode']:>13} {r['ms_per_step']:9.1f} {rel} "
              f"{r['inter_node_mb_per_step_per_node']:18.4f} {'-' if tel is None else f'{tel:18.4f}'}")
    name = "nodes" if task == "classifier" else f"nodes_{task}"
    (out / f"{name}.json").write_text(json.dumps({"rows": rows}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = sorted({r["link"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, field, label in ((axes[0], "ms_per_step", "ms per step"),
                             (axes[1], "inter_node_mb_per_step_per_node", "inter-node MB per step per node")):
        modes = list(dict.fromkeys(r["mode"] for r in rows))
        width = 0.8 / max(len(links), 1)
        for j, link in enumerate(links):
            vals = [next((r[field] for r in rows if r["link"] == link and r["mode"] == m), 0) for m in modes]
            ax.bar([i + j * width for i in range(len(modes))], vals, width, label=link)
        ax.set_xticks([i + width * (len(links) - 1) / 2 for i in range(len(modes))], modes, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"2 nodes x 2 ranks (network namespaces, tc-throttled veth), {TASKS[task][0]}")
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", default="100mbit 1gbit")
    p.add_argument("--modes", default=" ".join(MODES))
    p.add_argument("--task", choices=tuple(TASKS), default="classifier",
                   help="the workload: the main job's classifier, or the LM whose time to target "
                        "launch/bench_nodes_ttq.py reports")
    p.add_argument("--steps", default=None, help="S1 S2: per-step numbers are (S2 - S1)'s differences "
                   "(default: classifier 20 60, lm 30 90)")
    p.add_argument("--out", default=str(REPO / "runs" / "bench_nodes"))
    p.add_argument("--timeout", type=int, default=900)
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench_nodes.py: needs root (network namespaces, tc)")
    bad = [m for m in a.modes.split() if m not in MODES]
    if bad:
        sys.exit(f"bench_nodes.py: unknown mode(s) {bad}; choose from {list(MODES)}")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    s1, s2 = (int(x) for x in (a.steps or TASKS[a.task][-1]).split())
    t0 = time.time()
    rows = measure(a.links.split(), a.modes.split(), s1, s2, out, a.timeout, a.task)
    report(rows, out, a.task)
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
