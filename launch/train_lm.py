"""Second main-job task: a small byte-level GPT on the Python standard library's sources, data-parallel with
DeepSpeed (+ DRAGONN). The model family whose convergence under compression the sweep measures.

Launch (2 ranks, CPU or GPU):
    deepspeed --num_gpus 2 launch/train_lm.py --deepspeed_config configs/lm_dragonn.json --summary out.json
    (configs/lm_local_steps.json: local steps, an outer step every 30 steps with a DRAGONN pseudo-gradient)

Data: every ``*.py`` file of this interpreter's standard library (``sysconfig``'s ``stdlib``; no download),
sorted by path, read as bytes; every 10th file is held out (a fixed split for a given Python version,
recorded in the summary). Each rank draws its own training windows of ``ctx + 1`` bytes; the held-out loss
(nats/byte) is the mean next-byte cross-entropy over a fixed set of held-out windows, the same on every rank.
Only rank 0 logs and writes the summary.
"""
from __future__ import annotations

import math
import platform
import sysconfig
import time
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn.functional as F

import ds_dragonn
from ds_dragonn.comm.mpi_env import setup_mpi_env
from bench.job import finish, install_baselines, job_parser  # launch/bench, beside this script

# -- defaults (units in comments) -----------------------------------------------------------------------
STEPS = 500            # optimizer steps
LOG_INTERVAL = 50      # steps between log lines (and held-out evaluations)
N_LAYER, D_MODEL, N_HEAD = 4, 192, 4  # -> ~1.85 M parameters
CTX = 128              # bytes of context
HELD_OUT_EVERY = 10    # every 10th file (sorted by path) is held out
EVAL_WINDOWS = 256     # held-out windows per evaluation
MAX_TRAIN_BYTES = 16 << 20  # training text used (bytes, from the start of the sorted file list)
SEED = 1234


def get_args():
    p = job_parser(__doc__.splitlines()[0], STEPS, LOG_INTERVAL, SEED)
    p.add_argument("--n-layer", type=int, default=N_LAYER)
    p.add_argument("--d-model", type=int, default=D_MODEL)
    p.add_argument("--n-head", type=int, default=N_HEAD)
    p.add_argument("--ctx", type=int, default=CTX)
    p.add_argument("--eval-windows", type=int, default=EVAL_WINDOWS)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def stdlib_corpus(held_out_every: int = HELD_OUT_EVERY, max_train_bytes: int = MAX_TRAIN_BYTES):
    """(train, held-out) uint8 tensors of the standard library's ``*.py`` files, files joined by a 0 byte.

    Files are sorted by path relative to the stdlib folder; ``site-packages`` is skipped; file ``i`` is held
    out when ``i % held_out_every == held_out_every - 1``. Raises FileNotFoundError without any source file.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    if not files:
        raise FileNotFoundError(f"no *.py files under the standard library folder {root}")
    train, held, size = [], [], 0
    for i, path in enumerate(files):
        data = path.read_bytes() + b"\0"
        if i % held_out_every == held_out_every - 1:
            held.append(data)
        elif size < max_train_bytes:
            train.append(data)
            size += len(data)
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train)[:max_train_bytes], as_tensor(held)


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteGPT(torch.nn.Module):
    """(B, T) uint8/int64 bytes -> (B, T, 256) next-byte logits."""

    def __init__(self, n_layer: int, d: int, heads: int, ctx: int):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(256, d), torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(n_layer))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, 256)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def windows(data: torch.Tensor, starts: torch.Tensor, ctx: int):
    """(inputs, targets) int64 (B, ctx) from byte offsets ``starts``."""
    rows = torch.stack([data[s:s + ctx + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def held_out_loss(model, x, y, batch: int = 32) -> float:
    """Mean next-byte cross-entropy (nats/byte) over fixed held-out windows; ``model``: a DeepSpeed engine or
    any torch module (launch/bench_ttq.py evaluates DDP and plain modules too)."""
    device = next(model.parameters()).device
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = model(x[i:i + batch].to(device)).float()
            total += F.cross_entropy(logits.reshape(-1, 256), y[i:i + batch].to(device).reshape(-1),
                                     reduction="sum").item()
    model.train()
    return total / y.numel()


def main():
    args = get_args()
    setup_mpi_env()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    train, held = stdlib_corpus()
    eval_gen = torch.Generator().manual_seed(args.seed)
    eval_x, eval_y = windows(held, torch.randint(0, len(held) - args.ctx - 1, (args.eval_windows,),
                                                 generator=eval_gen), args.ctx)
    model = ByteGPT(args.n_layer, args.d_model, args.n_head, args.ctx)
    engine, _, _, _ = ds_dragonn.initialize(args=args, model=model, model_parameters=model.parameters())
    hier_dense = install_baselines(engine, args)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dragonn = getattr(engine, "dragonn", None)
    if rank == 0:
        print(f"world_size={world} params={sum(p.numel() for p in model.parameters())} "
              f"train_bytes={len(train)} held_out_bytes={len(held)} ctx={args.ctx} micro_batch={micro} "
              f"gradient_accumulation={gas} steps={args.steps} "
              f"dragonn={'on density=%g' % dragonn.cfg.density if dragonn else 'off'}", flush=True)

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own windows
    t0, loss_sum, loss_n, last_loss, history = time.time(), 0.0, 0, float("nan"), []
    for step in range(1, args.steps + 1):
        for _ in range(gas):
            x, y = windows(train, torch.randint(0, len(train) - args.ctx - 1, (micro,), generator=gen), args.ctx)
            logits = engine(x.to(engine.device)).float()
            loss = F.cross_entropy(logits.reshape(-1, 256), y.to(engine.device).reshape(-1))
            engine.backward(loss)
            engine.step()
            loss_sum, loss_n = loss_sum + loss.item(), loss_n + 1
        if step % args.log_interval == 0 or step == args.steps:
            last_loss = loss_sum / loss_n
            test_loss = held_out_loss(engine, eval_x, eval_y)
            sent = dragonn.telemetry.bytes_sent if dragonn else None
            history.append({"step": step, "test_loss": test_loss, "train_loss": last_loss, "bytes_sent": sent})
            if rank == 0:
                line = (f"step {step:5d} | loss {last_loss:.4f} | held-out {test_loss:.4f} nats/byte | "
                        f"{(time.time() - t0) / step * 1e3:.1f} ms/step")
                if dragonn:
                    t = dragonn.telemetry
                    line += f" | sent {t.bytes_sent / 1e6:.2f} MB vs dense {t.dense_bytes_equivalent / 1e6:.2f} MB"
                    if dragonn.cfg.sync.value == "local_steps":
                        line += f" | {t.outer_syncs} outer steps, {t.local_steps_taken} local steps"
                    else:
                        line += f" | {t.compressed_reductions} compressed / {t.dense_reductions} dense"
                print(line, flush=True)
            loss_sum, loss_n = 0.0, 0

    summary = {"task": "lm", "world_size": world, "steps": args.steps, "dragonn_enabled": dragonn is not None,
               "density": dragonn.cfg.density if dragonn else 1.0,
               "exchange": dragonn.exchange_name if dragonn else None, "metric": "test_loss",
               "test_loss": history[-1]["test_loss"] if history else math.nan, "final_loss": last_loss,
               "history": history, "wall_s": time.time() - t0, "python": platform.python_version(),
               "train_bytes": len(train), "held_out_bytes": len(held),
               **({"hierarchy": hier_dense} if hier_dense else {})}
    finish(summary, dragonn, model, world, rank,
           f"test_loss {summary['test_loss']:.4f} nats/byte | final_loss {last_loss:.4f}", args.summary)


if __name__ == "__main__":
    main()
