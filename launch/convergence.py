"""Convergence sweep: held-out quality of DRAGONN against dense DeepSpeed and the baselines, on both main-job tasks.

For each task (``classifier``: launch/train.py, ``lm``: launch/train_lm.py), with 2 ranks, the same seeds and
the same steps, every run below goes through the ``deepspeed`` launcher with a config written from the task's
dense / DRAGONN config plus the run's ``"dragonn"`` overrides:

====================  ================================================================================
dense                 DeepSpeed's dense allreduce
dragonn_0.01          DRAGONN at density 0.01 with the defaults (global selection, dense warm-up ``auto``:
                      twice the learning-rate warm-up, at least 30 steps (LM: 100; classifier, no scheduler: 30),
                      density warm-up ``auto``: 0.25 -> 0.01 over three times the dense warm-up, at least
                      100 steps (LM: 300); ``compress`` auto: the momentum mode
                      for these Adam-type optimizers)
dragonn_0.001         the same at density 0.001
gradient_0.01         the defaults with ``compress: gradient`` (error feedback on the gradient)
gradient_0.001        the same at density 0.001
momentum_0.01         the defaults with ``compress: momentum`` (1-bit Adam's structure), named explicitly
momentum_0.001        the same at density 0.001
no_density_warmup_*   the defaults without the density warm-up (straight from the dense warm-up to the density)
warm100_0.01          the defaults with a 100-step dense warm-up (``warmup_steps`` 100); warm100_0.001 the same
warm30_0.01           the defaults with the 30-step dense warm-up that was the default before ``auto``;
                      warm30_0.001 the same
dw100_0.01            the defaults with the 100-step density warm-up that was the default before ``auto``;
                      dw100_0.001 the same
dw300_0.01            the defaults with a 300-step density warm-up (``density_warmup_steps`` 300);
                      dw300_0.001 the same
dw500_0.001           density 0.001 with a 500-step density warm-up (the fall from 0.25 at 0.01's pace per
                      decade); dw1000_0.001 with a 1000-step one
age30_0.001           density 0.001 with the age bound ``advanced.max_age`` 30; age100_0.001, age300_0.001
                      with 100 / 300; age100_0.01 at 0.01
dq4_int4_0.001        density 0.001, int4 values and int4 dense steps; dq4_int4_age100_0.001 with max_age 100
dq4_int4_dw1000_*     the same with a 1000-step density warm-up, at 0.001 and 0.01; dq4_int4_age300_0.001,
                      dq4_int4_dw1000_age300_0.001 with max_age 300; age30_0.01: max_age 30 at 0.01
legacy_0.01           gradient mode with the earlier defaults: no warm-ups
no_ef_0.01            gradient mode without error feedback
partitioned_0.01      gradient mode with the partitioned exchange
====================  ================================================================================

``--lm-optimizer robust`` trains the LM with a second, differently tuned AdamW (β2 0.95, weight decay 0.1;
clipping 1.0 and a learning rate decaying to 0 at the last step as always), to check that the defaults
are not tuned to one configuration.

Writes ``<out>/convergence.json`` (one record per run and seed: task, run, selection, exchange, density,
error_feedback, warmup, seed, steps, metric, value, bytes_sent, dense_bytes_equivalent, wall_s, history),
``<out>/convergence.md`` (a table per task: mean and spread over seeds, gap to dense, bytes ratio) and
``<out>/convergence.png`` (held-out metric against step and against cumulative bytes sent; one panel per
task, one line per run). Runs of keys since removed (``lrw_*``, ``per_tensor_0.01``, ``freeze_0.01``, and ``topk_0.01`` / ``randomk_0.01``
of ``advanced.compressor``: the baselines live in ``launch/bench/baselines.py``, outside the config) stay
in the committed records (docs/results.md) but can no longer be run. ``--quick`` runs a short sweep (fewer steps, a smaller LM, three runs a task).

    bash launch/convergence.sh [--quick] [--out docs/results/convergence] [--tasks classifier,lm] [--seeds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import free_port, pyplot, remove_shm, save_figure, write_json

REPO = Path(__file__).resolve().parent.parent

#: run name -> "dragonn" overrides (None: dense); the local-steps runs measured before "outer_lr" defaulted to
#: "auto" (the square root of the workers) pin the 1.0 they were measured with
RUNS = {
    "dense": None,
    "dragonn_0.01": {"density": 0.01},
    "dragonn_0.001": {"density": 0.001},
    # only "sync" set: the Δ's density, value format and outer lr are the "auto" defaults (plan.resolve_defaults)
    "local_auto": {"sync": "local_steps"},
    # the same without the shared dense warm-up (candidate default of "warmup_steps" under local steps)
    "local_auto_w0": {"sync": "local_steps", "warmup_steps": 0},
    "local_auto_w30": {"sync": "local_steps", "warmup_steps": 30},
    # the defaults before the value formats and the age bound followed the density (and 0.001's 300-step ramp)
    "dtype_0.01": {"density": 0.01, "advanced": {"values": "dtype", "dense_values": "dtype", "max_age": 0}},
    "dtype_0.001": {"density": 0.001, "density_warmup_steps": 300,
                    "advanced": {"values": "dtype", "dense_values": "dtype", "max_age": 0}},
    "gradient_0.01": {"density": 0.01, "compress": "gradient"},
    "gradient_0.001": {"density": 0.001, "compress": "gradient"},
    "momentum_0.01": {"density": 0.01, "compress": "momentum"},
    "momentum_0.001": {"density": 0.001, "compress": "momentum"},
    "no_density_warmup_0.01": {"density": 0.01, "density_warmup_steps": 0},
    "no_density_warmup_0.001": {"density": 0.001, "density_warmup_steps": 0},
    "warm100_0.01": {"density": 0.01, "warmup_steps": 100},
    "warm100_0.001": {"density": 0.001, "warmup_steps": 100},
    "warm30_0.01": {"density": 0.01, "warmup_steps": 30},
    "warm30_0.001": {"density": 0.001, "warmup_steps": 30},
    "dw100_0.01": {"density": 0.01, "density_warmup_steps": 100},
    "dw100_0.001": {"density": 0.001, "density_warmup_steps": 100},
    "dw300_0.01": {"density": 0.01, "density_warmup_steps": 300},
    "dw300_0.001": {"density": 0.001, "density_warmup_steps": 300},
    "dw500_0.001": {"density": 0.001, "density_warmup_steps": 500},
    "dw1000_0.001": {"density": 0.001, "density_warmup_steps": 1000},
    "legacy_0.01": {"density": 0.01, "warmup_steps": 0, "density_warmup_steps": 0, "compress": "gradient"},
    "no_ef_0.01": {"density": 0.01, "advanced": {"error_feedback": False}, "compress": "gradient"},
    "partitioned_0.01": {"density": 0.01, "exchange": "partitioned", "compress": "gradient"},
    # several nodes (--nodes 2): the defaults flat, and node-aware (dense inside the node, a shard across)
    "flat_0.01": {"density": 0.01, "hierarchy": "flat"},
    "node_0.01": {"density": 0.01, "hierarchy": "node"},
    # local steps (uncompressed DiLoCo, H = 30): every rank a worker, or each node one (dense inside the node)
    "diloco_flat": {"sync": "local_steps", "outer_lr": 1.0, "density": 1.0, "hierarchy": "flat"},
    "diloco_node": {"sync": "local_steps", "outer_lr": 1.0, "density": 1.0, "hierarchy": "node"},
    # quantized values on the wire (advanced.values): the defaults at 0.01 with int8 / int4 codes per 64 values
    "int8_0.01": {"density": 0.01, "advanced": {"values": "int8"}},
    "int4_0.01": {"density": 0.01, "advanced": {"values": "int4"}},
    # the dense steps (warm-up, variance refreshes) quantized too (advanced.dense_values, ZeRO 0)
    "dq8_0.01": {"density": 0.01, "advanced": {"dense_values": "int8"}},
    "dq8_int4_0.01": {"density": 0.01, "advanced": {"values": "int4", "dense_values": "int8"}},
    "dq4_int4_0.01": {"density": 0.01, "advanced": {"values": "int4", "dense_values": "int4"}},
    # the age bound (advanced.max_age): every entry sent at least every N compressed steps, one block of n / N per step whole
    "age30_0.001": {"density": 0.001, "advanced": {"max_age": 30}},
    "age100_0.001": {"density": 0.001, "advanced": {"max_age": 100}},
    "age300_0.001": {"density": 0.001, "advanced": {"max_age": 300}},
    "age100_0.01": {"density": 0.01, "advanced": {"max_age": 100}},
    "dq4_int4_0.001": {"density": 0.001, "advanced": {"values": "int4", "dense_values": "int4"}},
    "dq4_int4_dw1000_0.001": {"density": 0.001, "density_warmup_steps": 1000,
                              "advanced": {"values": "int4", "dense_values": "int4"}},
    "dq4_int4_dw1000_0.01": {"density": 0.01, "density_warmup_steps": 1000,
                             "advanced": {"values": "int4", "dense_values": "int4"}},
    "dq4_int4_age300_0.001": {"density": 0.001, "advanced": {"values": "int4", "dense_values": "int4", "max_age": 300}},
    "dq4_int4_dw1000_age300_0.001": {"density": 0.001, "density_warmup_steps": 1000,
                                     "advanced": {"values": "int4", "dense_values": "int4", "max_age": 300}},
    "age30_0.01": {"density": 0.01, "advanced": {"max_age": 30}},
    "dq4_int4_age100_0.001": {"density": 0.001, "advanced": {"values": "int4", "dense_values": "int4", "max_age": 100}},
    # chunk-wise selection (advanced.selection): every 4096 entries send their own top-k (SparseLoCo); per step,
    # and for local steps' Δ (H = 30) against the global threshold (local_0.01)
    "chunked_0.01": {"density": 0.01, "advanced": {"selection": "chunked"}},
    "chunked_0.001": {"density": 0.001, "advanced": {"selection": "chunked"}},
    "local_0.01": {"sync": "local_steps", "outer_lr": 1.0, "density": 0.01, "hierarchy": "flat"},
    # local steps' Δ with the unsent part kept in each rank's weights (the default below density 1.0: error reset, CSER)
    "local_kept_0.01": {"sync": "local_steps", "outer_lr": 1.0, "density": 0.01, "hierarchy": "flat"},
    "local_kept_0.001": {"sync": "local_steps", "outer_lr": 1.0, "density": 0.001, "hierarchy": "flat"},
    "local_kept_int4_0.01": {"sync": "local_steps", "outer_lr": 1.0, "density": 0.01, "hierarchy": "flat",
                             "advanced": {"values": "int4"}},
    "local_kept_sparseloco_0.01": {"sync": "local_steps", "outer_lr": 1.0, "density": 0.01, "hierarchy": "flat",
                                   "advanced": {"values": "int4", "selection": "chunked"}},
    "local_kept_h15_0.01": {"sync": "local_steps", "outer_lr": 1.0, "local_steps": 15, "density": 0.01,
                            "hierarchy": "flat"},
    "local_kept_w0_0.01": {"sync": "local_steps", "outer_lr": 1.0, "density": 0.01, "hierarchy": "flat",
                           "warmup_steps": 0},
    "diloco_w0": {"sync": "local_steps", "outer_lr": 1.0, "density": 1.0, "hierarchy": "flat", "warmup_steps": 0},
    "diloco_h15": {"sync": "local_steps", "outer_lr": 1.0, "local_steps": 15, "density": 1.0, "hierarchy": "flat"},
    # where local steps lose steps: H = 1 averages the weights after every step (only Adam's state stays local)
    "diloco_h1": {"sync": "local_steps", "outer_lr": 1.0, "local_steps": 1, "density": 1.0, "hierarchy": "flat"},
    "diloco_h4": {"sync": "local_steps", "outer_lr": 1.0, "local_steps": 4, "density": 1.0, "hierarchy": "flat"},
    # ... each rank's Adam normalizes its own half-batch gradient: an outer lr of sqrt(workers) undoes the averaging
    "diloco_h1_olr1.4": {"sync": "local_steps", "local_steps": 1, "density": 1.0, "hierarchy": "flat", "outer_lr": 1.4},
    "diloco_olr1.4": {"sync": "local_steps", "density": 1.0, "hierarchy": "flat", "outer_lr": 1.4},
    "diloco_olr2": {"sync": "local_steps", "density": 1.0, "hierarchy": "flat", "outer_lr": 2.0},
    "local_kept_0.1": {"sync": "local_steps", "outer_lr": 1.0, "density": 0.1, "hierarchy": "flat"},
    "local_kept_int4_olr1.4_0.1": {"sync": "local_steps", "density": 0.1, "hierarchy": "flat", "outer_lr": 1.4,
                                   "advanced": {"values": "int4"}},
    "local_chunked_0.01": {"sync": "local_steps", "outer_lr": 1.0, "density": 0.01, "hierarchy": "flat",
                           "advanced": {"selection": "chunked"}},
}
# the Δ kept in the weights at outer lr α and density d (docs/results.md, "A compressed Δ at density 0.1 ...")
RUNS.update({f"local_kept_olr{a}_{d}": {"sync": "local_steps", "density": float(d), "hierarchy": "flat",
                                        "outer_lr": float(a)}
             for a, d in (("1.4", "0.01"), ("1.4", "0.05"), ("1.4", "0.1"), ("1.4", "0.3"), ("2", "0.01"),
                          ("2", "0.1"), ("2.8", "0.01"), ("2.8", "0.1"))})
#: runs that change DeepSpeed's own keys or the script's arguments too: run name -> (DeepSpeed keys merged into the
#: task's config, "dragonn" overrides or None for dense, extra script arguments); for several nodes: the dense
#: allreduce node by node (launch/bench/hier_dense.py), ZeRO 3 (hpZ: the parameter all-gathers inside the node)
DS_RUNS = {
    "dense_fp32": ({"communication_data_type": "fp32"}, None, []),
    "hier_bf16": ({}, None, ["--hier-dense", "bf16"]),
    "zero3_dense": ({"zero_optimization": {"stage": 3}}, None, []),
    "zero3_hpz_0.01": ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
                       {"density": 0.01, "hierarchy": "flat"}, []),
    "zero3_hpz_gradient_0.01": ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
                                {"density": 0.01, "hierarchy": "flat", "compress": "gradient"}, []),
}
RUNS.update({name: over for name, (_, over, _) in DS_RUNS.items()})
#: --lm-optimizer robust: the LM's AdamW tuned differently (merged into the config's optimizer params)
ROBUST_ADAMW = {"betas": [0.9, 0.95], "weight_decay": 0.1}
#: keys kept from the task's DRAGONN config; every other key takes its default
BASE_KEYS = ("enabled", "policy", "min_compress_numel", "log_interval")
QUICK_RUNS = ("dense", "dragonn_0.01", "legacy_0.01")

#: task -> (script, dense config, DRAGONN config, metric, extra script arguments, quick extra arguments)
TASKS = {
    "classifier": ("launch/train.py", "configs/dense.json", "configs/dragonn.json", "test_accuracy",
                   ["--log-interval", "50"], ["--log-interval", "25"]),
    "lm": ("launch/train_lm.py", "configs/lm_dense.json", "configs/lm_dragonn.json", "test_loss",
           ["--n-layer", "4", "--d-model", "128", "--n-head", "4", "--ctx", "64", "--log-interval", "50",
            "--eval-windows", "256"],
           ["--n-layer", "2", "--d-model", "64", "--n-head", "2", "--ctx", "32", "--log-interval", "20",
            "--eval-windows", "64"]),
}


def get_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short sweep (about 4 minutes on 2 cores)")
    p.add_argument("--out", default=None,
                   help="output folder (default docs/results/convergence, runs/convergence_quick)")
    p.add_argument("--tasks", default="classifier,lm")
    p.add_argument("--runs", default=None, help="comma-separated run names (default: all; --quick: "
                                                 + ",".join(QUICK_RUNS) + ")")
    p.add_argument("--seeds", type=positive, default=None, help="classifier seeds (default 3; --quick 1)")
    p.add_argument("--lm-seeds", type=positive, default=1, help="LM seeds (default 1)")
    p.add_argument("--first-seed", type=int, default=1, help="seeds run from this one up")
    p.add_argument("--classifier-steps", type=positive, default=None, help="default 600 (--quick 100)")
    p.add_argument("--lm-steps", type=positive, default=None, help="default 300 (--quick 60)")
    p.add_argument("--ranks", type=positive, default=2, help="ranks per node")
    p.add_argument("--nodes", type=positive, default=1,
                   help="nodes: one launcher per node on this host (--hostfile --no_ssh --node_rank i, loopback)")
    p.add_argument("--lm-optimizer", choices=("default", "robust"), default="default",
                   help="robust: AdamW with betas (0.9, 0.95) and weight decay 0.1 for the LM")
    p.add_argument("--lm-lr", type=float, default=None,
                   help="the LM's peak learning rate (default: configs' 1e-3, under-tuned: dense ends 7.9 %% lower "
                        "at 2e-3, measured over 2000 steps)")
    a = p.parse_args()
    if a.lm_lr is not None and not 0.0 < a.lm_lr <= 1.0:
        p.error(f"--lm-lr must be a learning rate in (0, 1], got {a.lm_lr}")
    a.out = Path(a.out).resolve() if a.out else REPO / ("runs/convergence_quick" if a.quick else "docs/results/convergence")
    a.seeds = a.seeds if a.seeds is not None else (1 if a.quick else 3)
    a.classifier_steps = a.classifier_steps if a.classifier_steps is not None else (100 if a.quick else 600)
    a.lm_steps = a.lm_steps if a.lm_steps is not None else (60 if a.quick else 300)
    a.run_names = names_in(p, a.runs or ",".join(QUICK_RUNS if a.quick else RUNS), RUNS, "run")
    a.task_names = names_in(p, a.tasks, TASKS, "task")
    return a


def names_in(p: argparse.ArgumentParser, text: str, known, what: str) -> list:
    """The comma-separated names of ``text``, each once, in order; an argparse error names any not ``known``."""
    names = list(dict.fromkeys(text.split(",")))
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown {what}(s) {unknown}; choose from {', '.join(known)}")
    return names


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def write_config(task: str, run: str, steps: int, folder: Path, lm_optimizer: str = "default",
                 lm_lr: float | None = None) -> Path:
    """The run's DeepSpeed config: the task's dense or DRAGONN config with the run's overrides; the LM's
    learning-rate schedule decays over ``steps``, from a peak of ``lm_lr`` when given (the optimizer's ``lr``
    and the schedule's ``warmup_max_lr``)."""
    _, dense_cfg, dragonn_cfg, *_ = TASKS[task]
    over = RUNS[run]
    cfg = json.loads((REPO / (dense_cfg if over is None else dragonn_cfg)).read_text())
    if over is not None:  # the product's defaults, except what the run names
        cfg["dragonn"] = {**{k: cfg["dragonn"][k] for k in BASE_KEYS if k in cfg["dragonn"]}, **over}
    for key, value in DS_RUNS.get(run, ({}, None, []))[0].items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    if task == "lm" and lm_optimizer == "robust":
        cfg["optimizer"]["params"].update(ROBUST_ADAMW)
    sched = cfg.get("scheduler", {}).get("params", {})
    if task == "lm" and lm_lr is not None:
        cfg["optimizer"]["params"]["lr"] = float(lm_lr)
        if "warmup_max_lr" in sched:
            sched["warmup_max_lr"] = float(lm_lr)
    if "total_num_steps" in sched:
        sched["total_num_steps"] = steps
        sched["warmup_num_steps"] = min(sched.get("warmup_num_steps", 0), steps // 5)
    path = folder / f"{task}_{run}.json"
    return write_json(path, cfg)


def launch(task: str, run: str, seed: int, steps: int, args, folder: Path) -> dict:
    """One run under the deepspeed launcher; returns its summary (raises with the log tail on failure)."""
    script, *_, extra, quick_extra = TASKS[task]
    cfg = write_config(task, run, steps, folder, args.lm_optimizer, args.lm_lr)
    summary = folder / f"{task}_{run}_s{seed}.summary.json"
    log = folder / f"{task}_{run}_s{seed}.log"
    port = free_port()
    job = [script, "--deepspeed_config", str(cfg), "--steps", str(steps), "--seed", str(seed),
           "--summary", str(summary), *(quick_extra if args.quick else extra), *DS_RUNS.get(run, ({}, None, []))[2]]
    if args.nodes == 1:
        where = [["--num_gpus", str(args.ranks)]]
    else:  # the launcher's multi-node mode without ssh, one launcher per node, all on loopback
        hostfile = folder / f"hostfile_{args.nodes}x{args.ranks}"
        hostfile.write_text("".join(f"node{i} slots={args.ranks}\n" for i in range(args.nodes)))
        where = [["--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(i)] for i in range(args.nodes)]
    t0 = time.time()
    try:
        with open(log, "w") as f:
            procs = [subprocess.Popen(["deepspeed", *w, "--master_addr", "127.0.0.1", "--master_port", str(port), *job],
                                      cwd=REPO, stdout=f, stderr=subprocess.STDOUT) for w in where]
            codes = [p.wait(timeout=1800 * args.nodes) for p in procs]
    finally:  # DeepSpeed's CPU allreduce leaves a /dev/shm file per rank and port
        remove_shm(port)
    if any(codes) or not summary.exists():
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{task}/{run} seed {seed} failed (exit {codes}); {log}:\n{tail}")
    out = json.loads(summary.read_text())
    out["launch_s"] = time.time() - t0
    return out


def record(task: str, run: str, seed: int, steps: int, s: dict) -> dict:
    """The sweep's record of one run (the fields listed in the module docstring) plus its history."""
    over = RUNS[run]
    cfg = json.loads((REPO / TASKS[task][2]).read_text())["dragonn"] if over is not None else {}
    from ds_dragonn.config import DragonnConfig  # the defaults the run used
    d = DragonnConfig(**{**{k: cfg[k] for k in BASE_KEYS if k in cfg}, **over}) if over is not None else None
    metric = TASKS[task][3]
    history = []
    for h in s.get("history", []):
        sent = h.get("bytes_sent")
        if sent is None:  # dense: the same bytes every step
            sent = s["bytes_sent"] * h["step"] / max(s["steps"], 1)
        history.append({"step": h["step"], "value": h[metric], "bytes_sent": sent})
    return {
        "task": task, "run": run,
        "selection": (d.selection.value if d else None),  # global or chunked (advanced.selection)
        "exchange": (d.exchange.value if d else "dense"),
        "compressor": ("dragonn" if d else "dense"), "density": (d.density if d else 1.0),
        "error_feedback": (d.error_feedback if d else None),
        "warmup": ({"warmup_steps": s.get("dragonn_warmup_steps", d.warmup_steps),  # as resolved ("auto")
                    "density_warmup_steps": s.get("dragonn_density_warmup_steps", d.density_warmup_steps),
                    "density_warmup_start": d.density_warmup_start} if d else None),
        "seed": seed, "steps": steps, "metric": metric, "value": s[metric],
        "bytes_sent": s["bytes_sent"], "dense_bytes_equivalent": s["dense_bytes_equivalent"],
        "wall_s": s["wall_s"], "history": history,
    }


def table(records: list, task: str) -> list[str]:
    """Markdown rows: per run, the mean (± spread over seeds) of the metric, its gap to dense, the bytes ratio."""
    rows = [r for r in records if r["task"] == task]
    runs = list(dict.fromkeys(r["run"] for r in rows))
    metric = rows[0]["metric"]
    dense = [r["value"] for r in rows if r["run"] == "dense"]
    dense_mean = statistics.mean(dense) if dense else None
    dense_bytes = statistics.mean(r["bytes_sent"] for r in rows if r["run"] == "dense") if dense else None
    unit = "accuracy (%)" if metric == "test_accuracy" else "held-out loss (nats/byte)"
    gap_unit = "points" if metric == "test_accuracy" else "%"
    out = [f"| run | seeds | {unit} | spread (min–max) | gap to dense ({gap_unit}) | bytes vs dense | wall s |",
           "|---|---|---|---|---|---|---|"]
    scale = 100.0 if metric == "test_accuracy" else 1.0
    for run in runs:
        vals = [r["value"] for r in rows if r["run"] == run]
        mean = statistics.mean(vals)
        if dense_mean is None:
            gap = "–"
        elif metric == "test_accuracy":
            gap = f"{(mean - dense_mean) * 100:+.2f}"
        else:
            gap = f"{(mean / dense_mean - 1) * 100:+.2f}"
        sent = statistics.mean(r["bytes_sent"] for r in rows if r["run"] == run)
        ratio = f"{sent / dense_bytes:.4f}" if dense_bytes else "–"
        wall = statistics.mean(r["wall_s"] for r in rows if r["run"] == run)
        out.append(f"| {run} | {len(vals)} | {mean * scale:.3f} | {min(vals) * scale:.3f}–{max(vals) * scale:.3f} "
                   f"| {gap} | {ratio} | {wall:.0f} |")
    return out


def plot(records: list, path: Path) -> None:
    plt = pyplot()
    tasks = list(dict.fromkeys(r["task"] for r in records))
    fig, axes = plt.subplots(2, len(tasks), figsize=(6.5 * len(tasks), 9), squeeze=False)
    for col, task in enumerate(tasks):
        rows = [r for r in records if r["task"] == task]
        metric = rows[0]["metric"]
        for run in dict.fromkeys(r["run"] for r in rows):
            first = next(r for r in rows if r["run"] == run)  # the first seed: one line per run
            h = first["history"]
            style = {"color": "black", "lw": 2.2} if run == "dense" else {"lw": 1.4}
            axes[0][col].plot([p["step"] for p in h], [p["value"] for p in h], marker=".", label=run, **style)
            axes[1][col].plot([p["bytes_sent"] / 1e6 for p in h], [p["value"] for p in h], marker=".", label=run,
                              **style)
        label = "held-out accuracy" if metric == "test_accuracy" else "held-out loss (nats/byte)"
        axes[0][col].set(title=f"{task}: {label} vs step (seed {rows[0]['seed']})", xlabel="optimizer step",
                         ylabel=label)
        axes[1][col].set(title=f"{task}: {label} vs bytes sent per rank", xlabel="cumulative MB sent per rank",
                         ylabel=label, xscale="log")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        if metric == "test_accuracy":
            for ax in axes[:, col]:
                ax.set_ylim(0.85, 1.0)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main() -> int:
    args = get_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "runs"
    work.mkdir(exist_ok=True)
    records, t0 = [], time.time()
    for task in args.task_names:
        steps = args.classifier_steps if task == "classifier" else args.lm_steps
        count = args.seeds if task == "classifier" else args.lm_seeds
        seeds = range(args.first_seed, args.first_seed + count)
        for seed in seeds:
            for run in args.run_names:
                s = launch(task, run, seed, steps, args, work)
                rec = record(task, run, seed, steps, s)
                records.append(rec)
                print(f"[{time.time() - t0:6.0f} s] {task:10s} {run:17s} seed {seed}: {rec['metric']} "
                      f"{rec['value']:.4f} | bytes {rec['bytes_sent'] / max(rec['dense_bytes_equivalent'], 1):.4f} "
                      f"of dense | {rec['wall_s']:.0f} s", flush=True)
    write_json(args.out / "convergence.json", {"records": records, "quick": args.quick, "ranks": args.ranks,
                                               "nodes": args.nodes,
                                               "lm_lr": args.lm_lr if "lm" in args.task_names else None,
                                               "lm_optimizer": args.lm_optimizer,
                                               "total_s": time.time() - t0}, indent=1)
    lines = [f"# Convergence sweep ({'quick' if args.quick else 'default'}; {args.nodes} node(s) x {args.ranks} ranks; "
             f"{time.time() - t0:.0f} s)", ""]
    for task in args.task_names:
        lines += [f"## {task}", ""] + table(records, task) + [""]
    (args.out / "convergence.md").write_text("\n".join(lines))
    plot(records, args.out / "convergence.png")
    print("\n".join(lines))
    print(f"wrote {args.out}/convergence.json, convergence.md, convergence.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
