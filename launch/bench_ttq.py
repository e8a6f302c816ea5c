"""Time to target: how long each gradient exchange takes to train the byte-level GPT of ``train_lm.py`` to a
held-out loss, on a slow link. The benchmark to decide by: it weighs what an exchange saves per step against
the steps its compression costs.

Model, data and held-out loss are ``launch/train_lm.py``'s (ByteGPT on the standard library's sources,
next-byte cross-entropy in nats/byte on fixed held-out windows); the training recipe is
``configs/lm_dense.json``'s (AdamW, bf16, 2 micro-batches per step, clipping 1.0, WarmupDecayLR over the
run), 2 ranks. Every mode starts from the same initial weights and draws the same training windows.

Method
  time to target = steps to target × step time on the link.
  1. Quality phase (unthrottled loopback, no root needed): each mode trains the full run (--steps); rank 0
     evaluates the held-out loss every --eval-every steps. DRAGONN runs here use "policy": "always" (on
     loopback "auto" may choose the dense allreduce, and the run would measure no compression).
  2. Target: the held-out loss of ds_fp32 (the dense fp32 allreduce) at --target-fraction (80 %) of its
     run, read from its curve by linear interpolation between the two evaluations around that step (an
     evaluation step when the fraction falls on one). Steps to target: the first evaluation at or below the
     target, linearly interpolated between it and the evaluation before it. A mode that never gets there is
     "not reached", with its final gap to the target (%).
  3. Timing phase (per link, two network namespaces joined by a veth pair throttled by tc tbf: root, see
     bench_ttq.sh): each mode runs --time-steps steps without evaluation; the first --time-untimed (plus,
     for DRAGONN's auto policy, its compressed probe steps) are not timed; the median step time of the
     others is the mode's step time. DRAGONN runs its own defaults here (policy auto), with its dense warm-up
     shortened to the untimed steps and no density warm-up, so the steady state is timed; the median of
     those dense warm-up steps (the first two left out) is its dense step time.
  4. Seconds to target = steps to target × median step ms, except that DRAGONN's dense warm-up steps
     (its "warmup_steps": by default twice the 50-step learning-rate warm-up, 100) are charged at its dense step time. The density warm-up that
     follows (by default three times the dense warm-up, 300) is not timed; each of its steps is charged
     between the steady step time and the dense one, linearly in its density (seconds_at: a model). PowerSGD's two
     dense start-up steps are charged at its steady step time.
  Bytes per step are computed per rank (DRAGONN: its telemetry; the others: ring-allreduce byte models of
  ds_dragonn.exchange.wire); the timing phase also records the veth's measured tx bytes.

Modes (a registry: a name and how to build it; DeepSpeed modes are keys merged into the LM config):
{modes}
Extra DeepSpeed modes from the command line: --mode NAME=JSON (JSON merged into configs/lm_dense.json,
e.g. --mode 'dragonn_d03={{"dragonn": {{"enabled": true, "density": 0.03}}}}').

Learning rate: --lr sets the peak learning rate of every mode (default configs/lm_dense.json's 1e-3, which is
under-tuned for this GPT: dense ends 12 % lower at 2e-3 and lower still at 4e-3). The target comes from
ds_fp32's run, so tune --lr on it first; the report refuses quality records at different learning rates
(timing records do not depend on it).

Usage:
    sudo bash launch/bench_ttq.sh                               # both phases, both links, then the report
    python launch/bench_ttq.py quality --out runs/ttq           # the quality phase alone (no root)
    python launch/bench_ttq.py quality --out runs/ttq --lr 4e-3 # ... at another peak learning rate
    python launch/bench_ttq.py report --out runs/ttq            # tables, JSON and PNG from the records
    python launch/bench_ttq.py list                             # the modes
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from argparse import Namespace
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from bench.link import link_mbit, tx_bytes

REPO = Path(__file__).resolve().parents[1]
BASE_CONFIG = REPO / "configs" / "lm_dense.json"

# -- defaults (units in comments) -----------------------------------------------------------------------
STEPS = 300               # optimizer steps of a quality run (2 micro-batches of 8 windows each per rank)
EVAL_EVERY = 30           # steps between held-out evaluations (80 % of 300 = 240 is an evaluation step)
TARGET_FRACTION = 0.8     # the target is ds_fp32's held-out loss at this fraction of its run
TIME_STEPS = 60           # steps of a timing run
TIME_UNTIMED = 10         # its first steps, not timed (allocations, DDP bucket rebuild, DRAGONN's dense steps)
TIME_ROUND = 10           # sync: local_steps: steps per round in the timing phase (several outer steps timed)
LINKS = ("100mbit", "1gbit")   # tc tbf rates of the timing phase
PLOT_LINK = "100mbit"     # the PNG's wall-clock axis
REFERENCE = "ds_fp32"     # its curve sets the target
BASELINE = "ds_bf16"      # the "x vs" column: its seconds to target / the mode's
RUN_TIMEOUT = 1800        # seconds one 2-rank run may take before it is killed and counted failed
SEED = 1234
WORLD = 2
QUICK = {"n_layer": 1, "d_model": 64, "n_head": 2, "ctx": 32, "eval_windows": 32, "steps": 40, "eval_every": 10,
         "time_steps": 14, "time_untimed": 4}  # ~85 k parameters: above DRAGONN's min_compress_numel
QUICK_MODES = ("ds_fp32", "dragonn")
QUICK_LINKS = ("100mbit",)


# -- the modes ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    """One way to exchange gradients. DeepSpeed modes give ``ds`` (keys deep-merged into the LM config, the
    mode's whole difference); the others give ``build(ctx) -> bench_link.Runner``."""
    name: str
    about: str
    ds: Optional[dict] = None
    build: Optional[Callable] = None
    reference: bool = False   # a yardstick (no exchange): shown, never declared the winner
    default: bool = True      # in the default run (False: registered, run with --modes)

    def config(self, base: dict) -> Optional[dict]:
        """The full DeepSpeed config of this mode (None for a non-DeepSpeed mode)."""
        return None if self.ds is None else deep_merge(base, self.ds)


def _build_none(ctx):
    from bench_link import setup_none
    return setup_none(ctx.model, ctx.args, recipe=ctx.recipe)


def _build_powersgd(rank: int):
    def build(ctx):
        from bench_link import setup_powersgd
        return setup_powersgd(ctx.model, ctx.args, ctx.world, rank, recipe=ctx.recipe)
    return build


def _build_ddp_bf16(ctx):
    from bench_link import setup_ddp_bf16
    return setup_ddp_bf16(ctx.model, ctx.args, ctx.world, recipe=ctx.recipe)


_ON = {"enabled": True}
REGISTRY: Dict[str, Mode] = {m.name: m for m in (
    # a bf16 ZeRO-0 engine accumulates its gradients in bf16 (fp32 accumulation is ZeRO-1+ only): "fp32" here
    # is the wire; with 2 ranks its result equals the bf16 allreduce's (a+b rounded once either way)
    Mode("ds_fp32", "DeepSpeed ZeRO-0, dense fp32 allreduce (communication_data_type fp32) of the bf16 gradients",
         ds={"communication_data_type": "fp32"}),
    Mode("ds_bf16", "DeepSpeed ZeRO-0, dense bf16 allreduce (communication_data_type bf16: a bf16 engine's default)",
         ds={"communication_data_type": "bf16"}),
    Mode("ddp_powersgd_r4", "torch DDP + PowerSGD rank 4 (error feedback, warm start; fp32 master, bf16 autocast)",
         build=_build_powersgd(4)),
    Mode("ddp_bf16", "torch DDP + bf16 compression hook (fp32 master, bf16 autocast)", build=_build_ddp_bf16),
    Mode("dragonn", "DRAGONN, the package's defaults (density 0.01, allgather, global selection; compress auto: "
         "each rank's local momentum under AdamW)", ds={"dragonn": dict(_ON)}),
    Mode("dragonn_gradient", "DRAGONN compressing the gradient (compress: gradient, the earlier default)",
         ds={"dragonn": {**_ON, "compress": "gradient"}}),
    Mode("dragonn_partitioned", "DRAGONN, partitioned exchange (sparse reduce-scatter to owners + allgather)",
         ds={"dragonn": {**_ON, "exchange": "partitioned"}}),
    Mode("dragonn_zero2", "DRAGONN under ZeRO-2 (sparse reduce-scatter of each micro-batch's gradients)",
         ds={"zero_optimization": {"stage": 2}, "dragonn": dict(_ON)}),
    Mode("dragonn_d0001", "DRAGONN, density 0.001", ds={"dragonn": {**_ON, "density": 0.001}}),
    # sync: local_steps (DiLoCo / SparseLoCo): registered, run with --modes (the local-steps sweep)
    *(Mode(f"local_h{h}_d{d}", f"DRAGONN local steps: an outer step every {h} steps, pseudo-gradient at density {d} "
           f"(error feedback, outer lr 1, no outer momentum: SparseLoCo's outer step)",
           ds={"dragonn": {**_ON, "sync": "local_steps", "local_steps": h, "density": d, "outer_lr": 1.0}},
           default=False)
      for h, d in ((8, 0.01), (30, 0.01), (100, 0.01), (30, 0.1))),
    *(Mode(f"kept_h{h}_d{d}", f"DRAGONN local steps every {h}, density {d}, the unsent pseudo-gradient kept in each "
           f"rank's weights (the default below density 1.0; error reset, CSER); 30 dense warm-up steps, as the "
           f"local-steps sweep of docs/results.md",
           ds={"dragonn": {**_ON, "sync": "local_steps", "local_steps": h, "density": d, "warmup_steps": 30,
                           "outer_lr": 1.0}}, default=False)
      for h, d in ((30, 0.01), (30, 0.001), (15, 0.01))),
    # DiLoCo's outer lr 0.7 with plain outer SGD: the outer step has no momentum (it made compressed local steps
    # worse, docs/results.md). Records of these modes made before the outer momentum left the package ran Nesterov 0.9.
    *(Mode(f"diloco_h{h}", f"uncompressed DiLoCo: an outer step every {h} steps, dense allreduce of the "
           f"pseudo-gradient, plain outer SGD at DiLoCo's lr 0.7",
           ds={"dragonn": {**_ON, "sync": "local_steps", "local_steps": h, "density": 1.0, "outer_lr": 0.7}},
           default=False)
      for h in (8, 30, 100)),
    Mode("none", "no exchange: each rank steps on its own gradients (the step time's physical limit)",
         build=_build_none, reference=True),
)}
DEFAULT_MODES = tuple(name for name, m in REGISTRY.items() if m.default)


def deep_merge(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s keys, nested objects merged key by key (neither argument is changed)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def parse_mode_def(text: str) -> Mode:
    """``NAME=JSON`` (a JSON object merged into the LM DeepSpeed config) -> a DeepSpeed :class:`Mode`.

    Raises ValueError naming the flag and what is wrong.
    """
    name, sep, spec = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        raise ValueError(f"--mode {text!r}: expected NAME=JSON, NAME of letters, digits and _.+- "
                         f"(e.g. --mode 'dragonn_d03={{\"dragonn\": {{\"enabled\": true, \"density\": 0.03}}}}')")
    if name in REGISTRY:
        raise ValueError(f"--mode {name}=...: {name!r} is a built-in mode; choose another name")
    try:
        over = json.loads(spec)
    except json.JSONDecodeError as err:
        raise ValueError(f"--mode {name}=...: the JSON does not parse: {err}") from None
    if not isinstance(over, dict):
        raise ValueError(f"--mode {name}=...: the JSON must be an object of DeepSpeed config keys, got {spec!r}")
    return Mode(name, f"DeepSpeed + {json.dumps(over)}", ds=over)


def resolve_modes(names: Sequence[str], defs: Sequence[str]) -> List[Mode]:
    """The modes to run: ``names`` from the registry, then every ``--mode NAME=JSON`` definition.

    Raises ValueError for an unknown or repeated name.
    """
    extra = [parse_mode_def(d) for d in defs]
    modes = []
    for n in names:
        if n not in REGISTRY:
            raise ValueError(f"--modes: unknown mode {n!r}; known: {', '.join(REGISTRY)} "
                             f"(or define one with --mode NAME=JSON)")
        modes.append(REGISTRY[n])
    modes += extra
    seen = [m.name for m in modes]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise ValueError(f"mode(s) given twice: {', '.join(dup)}")
    return modes


# -- the LM recipe --------------------------------------------------------------------------------------
def lm_config(steps: int, path: Path = BASE_CONFIG, lr: Optional[float] = None) -> dict:
    """configs/lm_dense.json with its scheduler stretched over ``steps`` (WarmupDecayLR: warm-up of the
    config's 50 steps, at most a quarter of the run, then linear decay to 0 at ``steps``); ``lr`` (when given)
    replaces the peak learning rate (the optimizer's ``lr`` and the schedule's ``warmup_max_lr``), for every
    mode alike: the torch modes' recipe reads the same config (:func:`lm_recipe`)."""
    cfg = json.loads(Path(path).read_text())
    params = cfg["scheduler"]["params"]
    params["total_num_steps"] = steps
    params["warmup_num_steps"] = max(1, min(params["warmup_num_steps"], steps // 4))
    if lr is not None:
        cfg["optimizer"]["params"]["lr"] = params["warmup_max_lr"] = float(lr)
    return cfg


def phase_config(cfg: Optional[dict], phase: str, untimed: int) -> Optional[dict]:
    """A mode's config as a phase runs it: DRAGONN with "policy" "always" in the quality phase; in the timing
    phase its dense warm-up cut to the untimed steps and no density warm-up (the steady state is timed)."""
    if cfg is None or not dragonn_block(cfg).get("enabled"):
        return cfg
    cfg = copy.deepcopy(cfg)
    if phase == "quality":
        cfg["dragonn"]["policy"] = "always"
    else:
        settings = dragonn_settings(cfg)
        warm = untimed if settings.warmup_steps == "auto" else min(settings.warmup_steps, untimed)  # auto >= 30
        cfg["dragonn"].update(warmup_steps=warm, density_warmup_steps=0)
        if settings.sync.value == "local_steps":  # several outer steps in the window (their cost is not H's)
            cfg["dragonn"]["local_steps"] = min(settings.local_steps, TIME_ROUND)
    return cfg


def round_step_ms(step_ms: Sequence[float], first_timed: int, warmup: int, timed_h: int, real_h: int) -> tuple:
    """``sync: local_steps``: the mean step time over a round of ``real_h`` steps, from a timing run whose rounds
    were ``timed_h`` steps: the median local step plus the median extra time of an outer step over ``real_h``
    (an outer step sends the same bytes whatever H). ``step_ms[i]`` is step ``i + 1``; steps from ``first_timed``
    (1-based) on are used. Returns (mean ms per step, median local ms, median outer-step overhead ms)."""
    timed = range(first_timed, len(step_ms) + 1)
    outer = [s for s in timed if s > warmup and (s - warmup) % timed_h == 0]
    local = [step_ms[s - 1] for s in timed if s not in outer]
    local_ms = _median(local)
    overhead = max(0.0, _median([step_ms[s - 1] for s in outer]) - local_ms) if outer and local else None
    if local_ms is None or overhead is None:
        return None, local_ms, overhead
    return local_ms + overhead / real_h, local_ms, overhead


def _dense_warmup(hook, dragonn, steps: int) -> int:
    """The dense warm-up steps a run of ``steps`` steps had: its hook's schedule ("auto" decided during the
    run; all of them where it never ended), else the settings' number, else 0 (no DRAGONN)."""
    if dragonn is None:
        return 0
    return min(steps, int(hook.schedule.warmup_steps if hook is not None else dragonn.warmup_steps))


def _density_warmup(hook) -> Optional[dict]:
    """The density warm-up a quality run had (``{"steps", "start", "density"}`` as resolved; None: none)."""
    schedule = getattr(hook, "schedule", None)
    if schedule is None or not schedule.steps:
        return None
    return {"steps": schedule.steps, "start": schedule.start, "density": schedule.density}


def dragonn_block(cfg: Optional[dict]) -> dict:
    return (cfg or {}).get("dragonn") or {}


def dragonn_settings(cfg: dict):
    """The validated DRAGONN block (the package's defaults filled in). Raises DragonnConfigError."""
    from ds_dragonn.config import DragonnConfig
    return DragonnConfig.from_ds_config(cfg)


def lm_loss(module, x, y):
    """Mean next-byte cross-entropy (nats/byte) of one micro-batch."""
    import torch.nn.functional as F
    device = next(module.parameters()).device
    logits = module(x.to(device)).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1))


def lm_recipe(cfg: dict):
    """The torch modes' recipe with the DeepSpeed config's hyper-parameters: AdamW (its params), WarmupDecayLR
    (its params), the same accumulation and clipping; fp32 parameters with a bf16 autocast forward when the
    config trains in bf16 (the fp32 master weights a bf16 DeepSpeed engine keeps)."""
    import torch
    from bench_link import Recipe

    def optimizer(params):
        from deepspeed.runtime.lr_schedules import WarmupDecayLR
        opt_params = {k: v for k, v in cfg["optimizer"]["params"].items() if k not in ("torch_adam", "adam_w_mode")}
        opt = torch.optim.AdamW(params, **opt_params)
        return opt, WarmupDecayLR(opt, **cfg["scheduler"]["params"])

    return Recipe(loss=lm_loss, optimizer=optimizer, accumulation=cfg.get("gradient_accumulation_steps", 1),
                  clip=cfg.get("gradient_clipping") or None,
                  autocast=torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else None)


@dataclass
class Context:
    """What a mode's build function gets."""
    model: object          # the ByteGPT, initialised from the seed
    world: int
    config: Optional[dict]  # the mode's DeepSpeed config (None: not a DeepSpeed mode)
    recipe: object         # bench_link.Recipe of the LM
    args: Namespace        # lr, seed, warmup_steps, as bench_link's set-ups read them


# -- one rank of one run --------------------------------------------------------------------------------
def _telemetry(engine) -> Optional[dict]:
    d = getattr(engine, "dragonn", None) if engine is not None else None
    if d is None:
        return None
    t = d.telemetry.summary()
    keys = ("compressed_reductions", "dense_reductions", "bytes_sent", "dense_bytes_equivalent", "achieved_density",
            "kept_over_k", "compress_ms_mean", "dense_ms_mean")
    return {k: t[k] for k in keys}


def run_rank(args) -> Optional[dict]:
    """Train one mode on this rank (env:// rendezvous from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
    return rank 0's record (None on the other ranks)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from train_lm import ByteGPT, held_out_loss, stdlib_corpus, windows

    known = {**REGISTRY, **{m.name: m for m in resolve_modes([], args.mode)}}
    if args.run not in known:
        raise ValueError(f"--run {args.run!r}: not a mode; known: {', '.join(known)}")
    mode = known[args.run]
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    quality = args.phase == "quality"
    base = lm_config(args.steps, lr=args.lr)
    cfg = phase_config(mode.config(base), args.phase, args.time_untimed)
    steps = args.steps if quality else args.time_steps

    train, held = stdlib_corpus()
    eval_gen = torch.Generator().manual_seed(args.seed)
    eval_x, eval_y = windows(held, torch.randint(0, len(held) - args.ctx - 1, (args.eval_windows,),
                                                 generator=eval_gen), args.ctx)
    torch.manual_seed(args.seed)
    model = ByteGPT(args.n_layer, args.d_model, args.n_head, args.ctx)
    params = sum(p.numel() for p in model.parameters())
    recipe = lm_recipe(base)
    untimed = 0 if quality else args.time_untimed
    ctx = Context(model, world, cfg, recipe, Namespace(lr=base["optimizer"]["params"]["lr"], seed=args.seed,
                                                       warmup_steps=untimed))
    if cfg is not None:
        from bench_link import deepspeed_runner
        runner = deepspeed_runner(model, cfg, ctx.args, recipe=recipe)
    else:
        runner = mode.build(ctx)
    engine = getattr(runner, "engine", None)
    hook = getattr(engine, "dragonn", None)  # its settings as resolved for the engine ("warmup_steps": "auto")
    dragonn = (hook.cfg if hook is not None else dragonn_settings(cfg)) if dragonn_block(cfg).get("enabled") else None
    micro, gas = base["train_micro_batch_size_per_gpu"], base["gradient_accumulation_steps"]
    autocast = (lambda: torch.autocast(model_device(runner.module).type, dtype=recipe.autocast)) \
        if cfg is None and recipe.autocast else nullcontext

    # timed window: after the untimed steps, and after DRAGONN's auto probes (its dense warm-up steps count as
    # the dense probes; then as many compressed ones; ZeRO-2 reduces per micro-batch: done sooner)
    first_timed = untimed + 1
    local = dragonn is not None and dragonn.sync.value == "local_steps"
    if dragonn is not None and not quality and dragonn.policy.value == "auto" and not local:
        from ds_dragonn.constants import AUTO_PROBE_STEPS as probes
        first_timed = max(first_timed, max(dragonn.warmup_steps, probes) + probes + 1)
    if not quality and first_timed > steps:
        raise ValueError(f"--time-steps {steps}: nothing left to time after {first_timed - 1} untimed steps; "
                         f"raise --time-steps")

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own windows, as train_lm
    step_ms, curve, t_start = [], [], time.time()
    tx0 = sent0 = tel0 = None
    for step in range(1, steps + 1):
        if step == first_timed:
            tx0, sent0, tel0 = tx_bytes(args.iface), runner.bytes_sent(), _telemetry(engine)
        x, y = windows(train, torch.randint(0, len(train) - args.ctx - 1, (micro * gas,), generator=gen), args.ctx)
        t0 = time.perf_counter()
        runner.step(x, y)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if quality and rank == 0 and (step % args.eval_every == 0 or step == steps):
            with autocast():
                loss = held_out_loss(runner.module, eval_x, eval_y)
            curve.append({"step": step, "loss": loss})
            print(f"{mode.name} step {step:5d} | held-out {loss:.4f} nats/byte | "
                  f"{(time.time() - t_start) / step * 1e3:.0f} ms/step", flush=True)
    sent1, tel1 = runner.bytes_sent(), _telemetry(engine)
    record = None
    if rank == 0:
        record = {"phase": args.phase, "mode": mode.name, "about": mode.about, "reference": mode.reference,
                  "world_size": world, "steps": steps, "seed": args.seed, "params": params,
                  "lr": peak_lr(cfg if cfg is not None else base),
                  "model": {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head, "ctx": args.ctx,
                            "micro_batch": micro, "gradient_accumulation": gas},
                  "config": cfg, "wall_s": round(time.time() - t_start, 2), "step_ms": [round(t, 2) for t in step_ms],
                  "telemetry": tel1}
        if quality:
            record.update(eval_every=args.eval_every, eval_windows=args.eval_windows, curve=curve,
                          final_loss=curve[-1]["loss"], bytes_per_step=sent1 / steps,
                          dense_warmup_steps=_dense_warmup(hook, dragonn, steps),
                          density_warmup=_density_warmup(hook),
                          variance_refresh_steps=_refresh_steps(engine))
        else:
            timed = steps - first_timed + 1
            tx1 = tx_bytes(args.iface)
            warm = _dense_warmup(hook, dragonn, steps)  # the timing run's dense steps
            dense = step_ms[2:warm] if warm > 2 else step_ms[:warm]  # the first two: one-time costs
            median = _median(step_ms[first_timed - 1:])
            if local:  # a round's mean: the outer step's time spread over the real H
                real_h = dragonn_settings(mode.config(base)).local_steps
                median, local_ms, outer_ms = round_step_ms(step_ms, first_timed, warm, dragonn.local_steps, real_h)
                record.update(local_step_ms=local_ms, outer_overhead_ms=outer_ms, local_steps=real_h)
            scale = dragonn.local_steps / real_h if local else 1.0  # bytes per step at the real H
            record.update(link=args.link, untimed_steps=first_timed - 1,
                          median_step_ms=median,
                          dense_step_ms=_median(dense) if dragonn is not None and dense else None,
                          bytes_per_step=(sent1 - sent0) / timed * scale,
                          tx_bytes_per_step=(tx1 - tx0) / timed * scale if tx0 is not None and tx1 is not None else None,
                          timed_telemetry=_delta(tel0, tel1))
    dist.barrier()
    dist.destroy_process_group()
    return record


def _refresh_steps(engine) -> int:
    """The momentum mode's variance-refresh interval of this run (0: none, or not the momentum mode)."""
    hook = getattr(engine, "dragonn", None)
    return hook.schedule.refresh_steps if hook is not None and getattr(hook, "momentum", None) is not None else 0


def model_device(module):
    return next(module.parameters()).device


def _median(xs):
    import statistics
    return statistics.median(xs) if xs else None


def _delta(t0: Optional[dict], t1: Optional[dict]) -> Optional[dict]:
    """Reductions and bytes of the timed window (what DRAGONN's policy chose on the link)."""
    if t0 is None or t1 is None:
        return None
    return {k: t1[k] - t0[k] for k in ("compressed_reductions", "dense_reductions", "bytes_sent")}


# -- running the ranks ----------------------------------------------------------------------------------
def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def launch_pair(worker_argv: List[str], log_prefix: Path, timeout: float, netns: Optional[Sequence[str]] = None,
                ifaces: Optional[Sequence[str]] = None, master_addr: str = "127.0.0.1",
                port: Optional[int] = None) -> int:
    """Run the 2 ranks of one run (``worker`` sub-command); 0 when both succeed.

    Without ``netns`` they meet on loopback; with it, rank r runs in namespace ``netns[r]`` and talks over
    ``ifaces[r]`` to ``master_addr``. The first rank to fail would leave its peer blocked in a collective: the
    peer is killed then. Past ``timeout`` seconds both are killed (124). Logs: ``<log_prefix>.rank<r>.log``.
    """
    from bench.common import free_port, remove_shm

    port = port or free_port()
    log_prefix.parent.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for r in range(WORLD):
            iface = ifaces[r] if ifaces else "lo"
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK="0", LOCAL_SIZE="1",
                       MASTER_ADDR=master_addr, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=iface,
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
            cmd = (["ip", "netns", "exec", netns[r]] if netns else []) + \
                [sys.executable, str(Path(__file__).resolve()), "worker", *worker_argv, "--iface", iface]
            with open(f"{log_prefix}.rank{r}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline, rc = time.monotonic() + timeout, 0
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                rc = failed[0] if failed else 124
                break
            time.sleep(0.2)
        _kill(procs)
        return rc or next((p.returncode for p in procs if p.returncode), 0)
    finally:
        _kill(procs)
        remove_shm(port, master_addr)


def _worker_argv(args, phase: str, mode: Mode, record: Path) -> List[str]:
    argv = ["--phase", phase, "--run", mode.name, "--record", str(record), "--seed", str(args.seed),
            "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--eval-windows", str(args.eval_windows),
            "--time-steps", str(args.time_steps), "--time-untimed", str(args.time_untimed),
            "--n-layer", str(args.n_layer), "--d-model", str(args.d_model), "--n-head", str(args.n_head),
            "--ctx", str(args.ctx), "--link", args.link or "unthrottled"]
    if args.lr is not None:
        argv += ["--lr", repr(args.lr)]
    for d in args.mode:
        argv += ["--mode", d]
    return argv


def run_phase(args, phase: str) -> int:
    """Every selected mode, one 2-rank run after the other; 1 if any failed (the others still run)."""
    out = Path(args.out)
    modes = resolve_modes(args.modes, args.mode)
    failed = []
    for i, mode in enumerate(modes):
        label = mode.name if phase == "quality" else f"{mode.name}@{args.link}"
        record = out / "records" / phase / f"{label}.json"
        record.unlink(missing_ok=True)
        log = out / "logs" / phase / label
        print(f"== {phase}: {label} ({mode.about})", flush=True)
        start = time.monotonic()
        rc = launch_pair(_worker_argv(args, phase, mode, record), log, args.run_timeout,
                         netns=args.netns, ifaces=args.ifaces, master_addr=args.master_addr,
                         port=args.port_base + i if args.netns else None)
        if rc == 0 and record.exists():
            rec = json.loads(record.read_text())
            what = (f"final held-out loss {rec['final_loss']:.4f}" if phase == "quality" else
                    f"median {rec['median_step_ms']:.1f} ms/step, {rec['bytes_per_step'] / 1e6:.3f} MB/step")
            print(f"   {what} ({time.monotonic() - start:.0f} s)", flush=True)
        else:
            failed.append(label)
            print(f"!! {label} failed (exit {rc}; 124: past --run-timeout {args.run_timeout} s); its log ends:",
                  file=sys.stderr)
            for r in range(WORLD):
                lines = Path(f"{log}.rank{r}.log").read_text(errors="replace").splitlines()
                print(f"-- rank {r}:\n" + "\n".join(lines[-15:]), file=sys.stderr)
    if failed:
        print(f"failed runs: {' '.join(failed)} (logs in {out / 'logs' / phase})", file=sys.stderr)
    return 1 if failed else 0


# -- the report (pure functions of the records: unit-testable without launching anything) ---------------
def loss_at(curve: Sequence[dict], step: float) -> float:
    """Held-out loss at ``step``, linearly interpolated between evaluations (clamped to the first/last)."""
    pts = sorted((c["step"], c["loss"]) for c in curve)
    if step <= pts[0][0]:
        return pts[0][1]
    for (s0, l0), (s1, l1) in zip(pts, pts[1:]):
        if step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return pts[-1][1]


def steps_to_target(curve: Sequence[dict], target: float) -> Optional[float]:
    """The first evaluation step whose held-out loss is <= ``target``, linearly interpolated between it and
    the evaluation before (the first evaluation itself when it is already there); None if never."""
    pts = sorted((c["step"], c["loss"]) for c in curve)
    for i, (s1, l1) in enumerate(pts):
        if l1 <= target:
            if i == 0:
                return float(s1)
            s0, l0 = pts[i - 1]
            return s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def seconds_at(step: float, ms: float, dense_ms: Optional[float] = None, dense_steps: int = 0,
               refresh_steps: int = 0, density_warmup: Optional[dict] = None) -> float:
    """Training seconds of the first ``step`` steps: the first ``dense_steps`` at ``dense_ms`` (DRAGONN's dense
    warm-up), and after them every ``refresh_steps``-th step too (the momentum mode's variance refreshes: a
    dense reduction, steps ``dense_steps + R − 1``, ``+ 2R − 1``, ...), the others at ``ms`` (median ms per step;
    a timing run is too short to contain a refresh).

    ``density_warmup`` (``{"steps": W, "start": s, "density": d}``, the quality run's density warm-up): its
    step ``j`` (at density ``d(j)``, schedule.py) is charged ``ms + (dense_ms − ms) · (d(j) − d) / (s − d)``, a
    model linear in the density between the steady step (density ``d``) and the dense step (at DGC's start of
    0.25 an (index, value) pair list is as many bytes as a bf16 allreduce). It is modelled, not timed: the
    timing phase times the steady state only. A variance refresh inside it is charged once (a dense step).
    No charge where ``start <= density`` (the schedule has no density warm-up then).

    Raises:
        ValueError: ``density_warmup`` lacks ``steps``, ``start`` or ``density``, or has ``steps`` < 0."""
    if dense_ms is None:
        return step * ms / 1e3
    warm = min(step, dense_steps)
    refreshes = math.floor((step - dense_steps) / refresh_steps) if refresh_steps and step > dense_steps else 0
    dense = warm + refreshes
    extra = 0.0  # the density warm-up's cost above the steady step
    if density_warmup:
        missing = [k for k in ("steps", "start", "density") if k not in density_warmup]
        if missing or int(density_warmup["steps"]) < 0:
            raise ValueError(f"density_warmup {density_warmup!r}: needs 'steps' >= 0, 'start' and 'density'")
        w, s0, d = int(density_warmup["steps"]), float(density_warmup["start"]), float(density_warmup["density"])
        if w and s0 > d and step > dense_steps and dense_ms > ms:
            done = min(step - dense_steps, w)
            whole = int(done)
            fractions = [1.0] * whole + ([done - whole] if done > whole else [])
            for j, f in enumerate(fractions):
                if refresh_steps and (j + 1) % refresh_steps == 0 and f == 1.0:
                    continue  # a refresh: already charged as a dense step above
                dj = s0 * (d / s0) ** (j / w)
                extra += f * (dense_ms - ms) * min(1.0, max(0.0, (dj - d) / (s0 - d)))
    return (dense * dense_ms + (step - dense) * ms + extra) / 1e3


def _check_same_setup(records: Sequence[dict]) -> None:
    keys = {(json.dumps(r["model"], sort_keys=True), r["seed"], r["world_size"]) for r in records}
    if len(keys) > 1:
        raise ValueError("the records come from different set-ups (model, seed or world size): "
                         + "; ".join(sorted(k[0] for k in keys)) + " - run every phase with the same options")


def peak_lr(cfg: Optional[dict]) -> Optional[float]:
    """A config's peak learning rate: its schedule's ``warmup_max_lr``, else its optimizer's ``lr`` (None: neither)."""
    cfg = cfg or {}
    lr = ((cfg.get("scheduler") or {}).get("params") or {}).get("warmup_max_lr")
    if lr is None:
        lr = ((cfg.get("optimizer") or {}).get("params") or {}).get("lr")
    return None if lr is None else float(lr)


def record_lr(record: dict) -> Optional[float]:
    """The peak learning rate a record ran at (``lr``; older records: their DeepSpeed config's; None if unknown:
    an older torch-mode record)."""
    return float(record["lr"]) if record.get("lr") is not None else peak_lr(record.get("config"))


def _check_same_lr(quality: Sequence[dict]) -> Optional[float]:
    """The quality records' common peak learning rate (None if no record names one). Raises ValueError when
    two differ, or when some records name one and others do not: steps to target compare methods at one
    learning rate (timing records do not depend on it)."""
    lrs = {q["mode"]: record_lr(q) for q in quality}
    known = [lr for lr in lrs.values() if lr is not None]
    if not known:
        return None
    lr = min(known)
    if not all(math.isclose(x, lr, rel_tol=1e-9) for x in known):
        raise ValueError("the quality records ran at different learning rates: "
                         + ", ".join(f"{m} {x!r}" for m, x in lrs.items() if x is not None)
                         + " - run the quality phase of every mode with the same --lr")
    unknown = [m for m, x in lrs.items() if x is None]
    if unknown:
        raise ValueError(f"no learning rate in the quality record(s) of {', '.join(unknown)} (made before --lr "
                         f"existed), while the others ran at {lr!r}: re-run their quality phase")
    return lr


def build_rows(quality: Sequence[dict], timing: Sequence[dict], fraction: float = TARGET_FRACTION,
               reference: str = REFERENCE, baseline: str = BASELINE) -> List[dict]:
    """One row per (link, mode) with a quality record: target, steps and seconds to target, gaps, bytes.

    Links are those of the timing records, slowest first; without any, one row per mode with link None (no
    seconds). Raises ValueError without a quality record of ``reference`` (it sets the target).
    """
    q_by = {q["mode"]: q for q in quality}
    if reference not in q_by:
        raise ValueError(f"no quality record of {reference!r} (its curve sets the target); have: "
                         f"{', '.join(q_by) or 'none'} - include {reference} in --modes")
    _check_same_setup([*quality, *timing])
    lr = _check_same_lr(quality)
    ref = q_by[reference]
    target_step = fraction * ref["steps"]
    target = loss_at(ref["curve"], target_step)
    t_by = {(t["mode"], t["link"]): t for t in timing}
    links = sorted({t["link"] for t in timing}, key=lambda l: (link_mbit(l) is None, link_mbit(l) or 0, l)) or [None]
    rows = []
    for link in links:
        for q in quality:
            t = t_by.get((q["mode"], link))
            reach = steps_to_target(q["curve"], target)
            ms = t["median_step_ms"] if t else None
            dense_ms, dense_steps = (t.get("dense_step_ms") if t else None), q.get("dense_warmup_steps", 0)
            refresh, ramp = q.get("variance_refresh_steps", 0), q.get("density_warmup")
            choice = None
            if t and t.get("timed_telemetry"):
                c, d = t["timed_telemetry"]["compressed_reductions"], t["timed_telemetry"]["dense_reductions"]
                choice = (None if not (c or d) else  # (local steps' dense outer steps: no per-step reductions)
                          "compressed" if c and not d else "dense" if d and not c else "mixed")
            rows.append({
                "mode": q["mode"], "link": link, "link_mbit": link_mbit(link), "reference": q.get("reference", False),
                "target_loss": target, "target_step": target_step, "target_fraction": fraction,
                "steps_to_target": reach, "median_step_ms": ms, "dense_step_ms": dense_ms,
                "dense_warmup_steps": dense_steps, "variance_refresh_steps": refresh,
                "density_warmup": ramp,
                "time_to_target_s": (seconds_at(reach, ms, dense_ms, dense_steps, refresh, ramp)
                                     if reach is not None and ms else None),
                "final_loss": q["final_loss"],
                "gap_vs_dense_pct": 100 * (q["final_loss"] - ref["final_loss"]) / ref["final_loss"],
                "final_gap_to_target_pct": None if reach is not None else 100 * (q["final_loss"] - target) / target,
                "bytes_per_step": t["bytes_per_step"] if t else q["bytes_per_step"],
                "bytes_source": "timing" if t else "quality",
                "tx_bytes_per_step": t.get("tx_bytes_per_step") if t else None,
                "timed_choice": choice, "steps": q["steps"], "lr": lr, "about": q.get("about", ""),
                "curve": [dict(c, seconds=seconds_at(c["step"], ms, dense_ms, dense_steps, refresh, ramp) if ms else None)
                          for c in q["curve"]]})
    for link in links:
        base = next((r for r in rows if r["link"] == link and r["mode"] == baseline), None)
        for r in rows:
            if r["link"] == link:
                ok = base and base["time_to_target_s"] and r["time_to_target_s"]
                r[f"x_vs_{baseline}"] = base["time_to_target_s"] / r["time_to_target_s"] if ok else None
    return rows


def verdict(rows: Sequence[dict]) -> str:
    """Which mode wins on these rows (one link), by how much, and why: seconds = steps x ms per step, so the
    ratio to the runner-up splits exactly into a step-time factor and a steps factor; the larger one is why.
    (ms per step here is seconds / steps: DRAGONN's dense warm-up included.)"""
    ok = sorted((r for r in rows if not r["reference"] and r["time_to_target_s"] is not None),
                key=lambda r: r["time_to_target_s"])
    if not ok:
        return "no mode reached the target (or none was timed on this link)"
    w = ok[0]
    text = f"{w['mode']} wins: {w['time_to_target_s']:.1f} s to target"
    if len(ok) == 1:
        return text + " (the only mode that reached it)"
    r = ok[1]
    eff = {x["mode"]: 1e3 * x["time_to_target_s"] / x["steps_to_target"] for x in (w, r)}
    ms_x, steps_x = eff[r["mode"]] / eff[w["mode"]], r["steps_to_target"] / w["steps_to_target"]
    text += (f", {r['time_to_target_s'] / w['time_to_target_s']:.2f}x faster than the runner-up {r['mode']} "
             f"({r['time_to_target_s']:.1f} s)")
    change = (w["steps_to_target"] - r["steps_to_target"]) / r["steps_to_target"] * 100
    steps_part = f"{w['steps_to_target']:.0f} vs {r['steps_to_target']:.0f} steps " + \
        (f"({abs(change):.0f} % {'fewer' if change < 0 else 'more'})" if round(change) else "(about the same)")
    warm = any(x["dense_step_ms"] is not None and x["dense_warmup_steps"] for x in (w, r))
    time_part = (f"{eff[w['mode']]:.0f} vs {eff[r['mode']]:.0f} ms/step ({ms_x:.2f}x)"
                 + (" on average over the steps to target, dense warm-up included" if warm else ""))
    if ms_x >= steps_x:
        return text + f"; why: step time, {time_part}; steps: {steps_part}"
    return text + f"; why: steps, {steps_part}; step time: {time_part}"


def _cell(value, fmt="{}"):
    return "-" if value is None else fmt.format(value)


def in_order(rows: Sequence[dict]) -> List[dict]:
    """Fastest to the target first; then those not timed or not reaching it; the yardstick (no exchange) last."""
    return sorted(rows, key=lambda r: (r["reference"], r["time_to_target_s"] is None, r["time_to_target_s"] or 0,
                                       r["steps_to_target"] is None, r["steps_to_target"] or 0, r["final_loss"]))


def format_rows(rows: Sequence[dict], baseline: str = BASELINE) -> str:
    """The table of one link (or of the quality phase alone): fastest to the target first."""
    from bench.common import format_table

    header = ["mode", "steps to target", "ms/step", "time to target (s)", f"x vs {baseline}", "final loss",
              "gap vs dense", "MB/step"]
    body = []
    for r in in_order(rows):
        reach = _cell(r["steps_to_target"], "{:.0f}") if r["steps_to_target"] is not None else \
            f"not reached ({r['final_gap_to_target_pct']:+.1f} %)"
        name = r["mode"] + (" (ref.)" if r["reference"] else "") + \
            (f" [auto: {r['timed_choice']}]" if r["timed_choice"] in ("dense", "mixed") else "")
        body.append([name, reach, _cell(r["median_step_ms"], "{:.1f}"), _cell(r["time_to_target_s"], "{:.1f}"),
                     _cell(r.get(f"x_vs_{baseline}"), "{:.2f}"), f"{r['final_loss']:.4f}",
                     f"{r['gap_vs_dense_pct'] + 0.0:+.2f} %".replace("-0.00", "+0.00"),
                     f"{r['bytes_per_step'] / 1e6:.3f}"])
    return format_table(header, body)


METHOD = ("time to target = steps to target x median step ms (DRAGONN's dense warm-up steps and the momentum "
          "mode's variance-refresh steps at its dense step time). Target: {ref}'s held-out loss at {pct:.0f} % of its run (step {tstep:g}, linear interpolation "
          "between evaluations) = {target:.4f} nats/byte. Steps to target: first evaluation at or below it, "
          "interpolated linearly from the one before; 'not reached': final gap to the target. Quality: one "
          "unthrottled run per mode (DRAGONN policy always); step time: median of a separate timed run on the "
          "link (DRAGONN policy auto). Gap vs dense: final held-out loss vs {ref}'s. MB/step: computed, per rank "
          "(timed run). x vs {base}: its time to target / the mode's. (ref.): no exchange, a yardstick only.")


def report_text(rows: Sequence[dict], reference: str = REFERENCE, baseline: str = BASELINE) -> str:
    r0 = rows[0]
    lines = ["Method: " + METHOD.format(ref=reference, pct=100 * r0["target_fraction"], tstep=r0["target_step"],
                                       target=r0["target_loss"], base=baseline)]
    if r0.get("lr") is not None:
        lines.append(f"Peak learning rate (every mode's quality run): {r0['lr']:g}")
    for link in dict.fromkeys(r["link"] for r in rows):
        sub = [r for r in rows if r["link"] == link]
        lines += ["", f"== link {link}" if link else "== quality phase only (no timing records: no seconds)",
                  format_rows(sub, baseline)]
        if link:
            lines.append(f"-> {link}: {verdict(sub)}")
    return "\n".join(lines)


def plot(rows: Sequence[dict], path, link: str = PLOT_LINK) -> str:
    """Held-out loss against training seconds on ``link`` (or the slowest link timed; or against steps when
    nothing was timed), the target as a dashed line. Returns the link plotted (or 'steps')."""
    from bench.common import pyplot, save_figure

    links = [l for l in dict.fromkeys(r["link"] for r in rows) if l]
    chosen = link if link in links else (links[0] if links else None)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in (r for r in rows if r["link"] == (chosen if chosen else None)):
        pts = [(c["seconds"] if chosen else c["step"], c["loss"]) for c in r["curve"]
               if not chosen or c["seconds"] is not None]
        w = r["dense_warmup_steps"]
        if chosen and pts and r["dense_step_ms"] is not None and 0 < w < r["curve"][-1]["step"]:
            # the end of the dense warm-up: where seconds per step change (the line bends there)
            pts = sorted(pts + [(seconds_at(w, r["median_step_ms"], r["dense_step_ms"], w,
                                            r.get("variance_refresh_steps", 0)), loss_at(r["curve"], w))])
        if pts:
            line, = ax.plot(*zip(*pts), marker=".", linestyle="--" if r["reference"] else "-", label=r["mode"])
            at = r["time_to_target_s"] if chosen else r["steps_to_target"]
            if at is not None:  # the reported crossing (interpolated in steps, then converted)
                ax.plot([at], [r["target_loss"]], marker="x", markersize=9, color=line.get_color())
    ax.axhline(rows[0]["target_loss"], color="black", linestyle=":", label="target (x: each mode's time to it)")
    ax.set_xlim(left=0)
    ax.set_xlabel(f"training seconds at {chosen}\n(steps x median ms per step; DRAGONN's dense warm-up and "
                  f"variance refreshes at its dense ms per step)" if chosen else "step")
    ax.set_ylabel("held-out loss (nats/byte)")
    lr = f", peak lr {rows[0]['lr']:g}" if rows[0].get("lr") is not None else ""
    ax.set_title(f"Time to target: byte-level GPT, {rows[0].get('steps')} steps{lr}, 2 ranks")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    save_figure(fig, path)
    return chosen or "steps"


def load_records(out: Path, phase: str) -> List[dict]:
    return [json.loads(p.read_text()) for p in sorted((Path(out) / "records" / phase).glob("*.json"))]


def report(args) -> int:
    from bench.common import write_json

    out = Path(args.out)
    quality, timing = load_records(out, "quality"), load_records(out, "timing")
    if not quality:
        raise SystemExit(f"bench_ttq.py report: no quality records in {out / 'records' / 'quality'}: "
                         f"run the quality phase first (bench_ttq.py quality --out {out})")
    try:
        lr = _check_same_lr(quality)
        if args.lr is not None and (lr is None or not math.isclose(lr, args.lr, rel_tol=1e-9)):
            raise ValueError(f"--lr {args.lr!r}: the quality records in {out} ran at {lr!r}; drop --lr to report "
                             f"them, or run the quality phase at --lr {args.lr!r}")
        rows = build_rows(quality, timing, args.target_fraction)
    except ValueError as err:
        raise SystemExit(f"bench_ttq.py report: {err}") from None
    print(report_text(rows))
    json_path = Path(args.json or out / "bench_ttq.json")
    write_json(json_path, {"method": METHOD.format(ref=REFERENCE, pct=100 * args.target_fraction,
                                                  tstep=rows[0]["target_step"], target=rows[0]["target_loss"],
                                                  base=BASELINE),
                           "verdicts": {r["link"]: verdict([x for x in rows if x["link"] == r["link"]])
                                        for r in rows if r["link"]},
                           "records": rows})
    png = Path(args.plot or out / "bench_ttq.png")
    chosen = plot(rows, png, args.plot_link)
    print(f"\nwrote {json_path} and {png} (held-out loss against {chosen})")
    return 0


# -- command line ---------------------------------------------------------------------------------------
def _words(text: str) -> List[str]:
    return [w for w in re.split(r"[,\s]+", text) if w]


def get_args(argv=None):
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("run settings (the same for every phase)")
    g.add_argument("--out", default=str(REPO / "runs" / "bench_ttq"), help="records, logs, JSON and PNG go here")
    g.add_argument("--modes", type=_words, default=None,
                   help=f"registry modes, space- or comma-separated (default: {' '.join(DEFAULT_MODES)}; "
                        f"--quick: {' '.join(QUICK_MODES)})")
    g.add_argument("--mode", action="append", default=[], metavar="NAME=JSON",
                   help="an extra DeepSpeed mode: JSON merged into configs/lm_dense.json (repeatable)")
    g.add_argument("--quick", action="store_true", help="tiny model and runs (a few minutes in all): plumbing only")
    g.add_argument("--steps", type=int, help=f"steps of a quality run (default {STEPS}; quick {QUICK['steps']})")
    g.add_argument("--eval-every", type=int, help=f"steps between held-out evaluations (default {EVAL_EVERY})")
    g.add_argument("--eval-windows", type=int, help="held-out windows per evaluation (default train_lm's 256)")
    g.add_argument("--time-steps", type=int, help=f"steps of a timing run (default {TIME_STEPS})")
    g.add_argument("--time-untimed", type=int, help=f"first steps of a timing run not timed (default {TIME_UNTIMED})")
    g.add_argument("--n-layer", type=int)
    g.add_argument("--d-model", type=int)
    g.add_argument("--n-head", type=int)
    g.add_argument("--ctx", type=int, help="bytes of context")
    g.add_argument("--seed", type=int, default=SEED)
    g.add_argument("--lr", type=float, help="peak learning rate of every mode (default: configs/lm_dense.json's "
                                            "1e-3); tune it on the dense run: the target comes from it")
    g.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT, help="seconds one 2-rank run may take")
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("quality", parents=[common], help="unthrottled full-length runs with held-out evaluations")
    t = sub.add_parser("timing", parents=[common], help="timed runs on one link (bench_ttq.sh sets it up)")
    t.add_argument("--link", required=True, help="the link's label, a tc rate (100mbit, 1gbit) or unthrottled")
    t.add_argument("--netns", type=_words, help="two network namespaces, one per rank (default: loopback)")
    t.add_argument("--ifaces", type=_words, help="the interface of each namespace (with --netns)")
    t.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address (with --netns: in its namespace)")
    t.add_argument("--port-base", type=int, default=29700,
                   help="with --netns: MASTER_PORT of the first run, +1 per run")
    r = sub.add_parser("report", parents=[common], help="tables, JSON and PNG from the records in --out")
    r.add_argument("--json", help="default: OUT/bench_ttq.json")
    r.add_argument("--plot", help="default: OUT/bench_ttq.png")
    r.add_argument("--plot-link", default=PLOT_LINK, help="the link whose seconds the PNG's x axis shows")
    r.add_argument("--target-fraction", type=float, default=TARGET_FRACTION)
    sub.add_parser("list", help="the registered modes")
    w = sub.add_parser("worker", parents=[common], help="(internal) one rank of one run")
    w.add_argument("--phase", choices=("quality", "timing"), required=True)
    w.add_argument("--run", required=True, help="the mode to run")
    w.add_argument("--record", required=True, help="rank 0 writes its record here")
    w.add_argument("--link", default="unthrottled")
    w.add_argument("--iface", help="interface whose tx bytes to read")
    args = p.parse_args(argv)
    if args.command == "list":
        return args
    defaults = {"steps": STEPS, "eval_every": EVAL_EVERY, "eval_windows": 256, "time_steps": TIME_STEPS,
                "time_untimed": TIME_UNTIMED, "n_layer": None, "d_model": None, "n_head": None, "ctx": None}
    from train_lm import CTX, D_MODEL, N_HEAD, N_LAYER
    defaults.update(n_layer=N_LAYER, d_model=D_MODEL, n_head=N_HEAD, ctx=CTX)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK.get(k, v) if args.quick else v)
    if args.modes is None:
        args.modes = list(QUICK_MODES if args.quick else DEFAULT_MODES)
    args.link = getattr(args, "link", None)
    for flag, ok in (("--steps", args.steps >= 1), ("--eval-every", 1 <= args.eval_every <= args.steps),
                     ("--eval-windows", args.eval_windows >= 1),
                     ("--lr", args.lr is None or 0 < args.lr <= 1),
                     ("--time-untimed", args.time_untimed >= 0),
                     ("--time-steps", args.time_steps > args.time_untimed),
                     ("--target-fraction", 0 < getattr(args, "target_fraction", 0.5) <= 1)):
        if not ok:
            p.error(f"{flag}: invalid value (need steps >= 1, 1 <= eval-every <= steps, 0 < lr <= 1, "
                    f"time-steps > time-untimed >= 0, 0 < target-fraction <= 1)")
    if args.command == "timing":
        if bool(args.netns) != bool(args.ifaces) or (args.netns and (len(args.netns), len(args.ifaces)) != (2, 2)):
            p.error("--netns and --ifaces go together, two names each (one per rank)")
        if not args.netns:
            args.netns = args.ifaces = None
    else:
        args.netns = args.ifaces = None
        args.master_addr, args.port_base = "127.0.0.1", 0
    try:
        for mode in resolve_modes(args.modes, args.mode):
            cfg = mode.config(lm_config(args.steps, lr=args.lr))
            if dragonn_block(cfg).get("enabled"):
                try:  # a bad "dragonn" block fails here, naming the mode, not in both ranks of its run
                    dragonn_settings(cfg)
                except ValueError as err:
                    raise ValueError(f"mode {mode.name}: {err}") from None
    except ValueError as err:
        p.error(str(err))
    return args


def _doc() -> str:
    return "\n".join(f"  {m.name:<20} {m.about}{'' if m.default else ' [not in the default run]'}"
                     for m in REGISTRY.values())


__doc__ = __doc__.format(modes=_doc())


def main(argv=None) -> int:
    args = get_args(argv)
    if args.command == "list":
        print(_doc())
        return 0
    if args.command == "worker":
        from bench.common import write_json
        record = run_rank(args)
        if record is not None:
            write_json(args.record, record)
        return 0
    if args.command == "report":
        return report(args)
    # a SIGTERM (bench_ttq.sh's clean-up, a timeout) ends the driver through its finally blocks: ranks killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return run_phase(args, args.command)


if __name__ == "__main__":
    sys.exit(main())
