"""Main job: an MLP classifier on real handwritten digits, data-parallel with DeepSpeed (+ DRAGONN).

Launch (2 ranks, CPU or GPU):
    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/dragonn.json --summary out.json

Data: scikit-learn's bundled UCI digits (1797 real 8x8 scans, no download); a fixed stratified 80/20
split; each rank trains on its own shard of every global batch. Only rank 0 logs and writes the summary.
"""
from __future__ import annotations

import time

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ds_dragonn
from ds_dragonn.comm.mpi_env import setup_mpi_env
from bench.job import finish, install_baselines, job_parser  # launch/bench, beside this script

# -- defaults (units in comments) -----------------------------------------------------------------------
STEPS = 600            # optimizer steps
LOG_INTERVAL = 50      # steps between log lines
HIDDEN = (512, 256)    # hidden widths -> ~166k parameters, one 166k-element gradient bucket
SEED = 1234            # model init, split and batch order (same on every rank)


def get_args():
    p = job_parser(__doc__.splitlines()[0], STEPS, LOG_INTERVAL, SEED)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def load_data(seed: int):
    """Digits as float32 tensors: (N, 64) features standardised on the training split, (N,) int64 labels."""
    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.data, digits.target, test_size=0.2,
                                              random_state=seed, stratify=digits.target)
    x_tr, x_te = torch.tensor(x_tr, dtype=torch.float32), torch.tensor(x_te, dtype=torch.float32)
    mean, std = x_tr.mean(0), x_tr.std(0).clamp_min(1e-3)
    return ((x_tr - mean) / std, torch.tensor(y_tr), (x_te - mean) / std, torch.tensor(y_te))


def build_model(in_features: int, classes: int) -> torch.nn.Module:
    layers, width = [], in_features
    for h in HIDDEN:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


def test_accuracy(engine, x_te, y_te, device, dtype) -> float:
    """Accuracy on the held-out split (360 digits), in [0, 1]; the engine is left in training mode."""
    engine.eval()
    with torch.no_grad():
        pred = engine(x_te.to(device=device, dtype=dtype)).argmax(1).cpu()
    engine.train()
    return (pred == y_te).float().mean().item()


def weights_agree(model: torch.nn.Module) -> bool:
    """Whether every rank holds bit-identical weights (a digest of each rank's, gathered: collective)."""
    import hashlib
    digest = hashlib.sha256(b"".join(p.detach().float().cpu().numpy().tobytes() for p in model.parameters()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest.hexdigest())
    return len(set(everyone)) == 1


def main():
    args = get_args()
    setup_mpi_env()  # under mpirun: RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR=127.0.0.1/MASTER_PORT from MPI's vars
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    model = build_model(x_tr.shape[1], 10)
    engine, _, _, _ = ds_dragonn.initialize(args=args, model=model, model_parameters=model.parameters())
    device, dtype = engine.device, next(engine.module.parameters()).dtype
    hier_dense = install_baselines(engine, args)
    micro = engine.train_micro_batch_size_per_gpu()
    global_batch = micro * world
    dragonn = getattr(engine, "dragonn", None)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"world_size={world} params={n_params} train={len(x_tr)} test={len(x_te)} "
              f"micro_batch={micro} global_batch={global_batch} steps={args.steps} "
              f"dragonn={'on density=%g' % dragonn.cfg.density if dragonn else 'off'}", flush=True)

    gen = torch.Generator().manual_seed(args.seed)  # same batch order on every rank
    perm, cursor = torch.randperm(len(x_tr), generator=gen), 0
    t0, loss_sum, loss_n, last_loss, history = time.time(), 0.0, 0, float("nan"), []
    for step in range(1, args.steps + 1):
        if cursor + global_batch > len(perm):
            perm, cursor = torch.randperm(len(x_tr), generator=gen), 0
        idx = perm[cursor + rank * micro: cursor + (rank + 1) * micro]
        cursor += global_batch
        xb, yb = x_tr[idx].to(device=device, dtype=dtype), y_tr[idx].to(device)
        loss = F.cross_entropy(engine(xb).float(), yb)
        engine.backward(loss)
        engine.step()
        loss_sum, loss_n = loss_sum + loss.item(), loss_n + 1
        if step % args.log_interval == 0 or step == args.steps:
            last_loss = loss_sum / loss_n
            line = f"step {step:5d} | loss {last_loss:.4f} | {(time.time() - t0) / step * 1e3:.1f} ms/step"
            if dragonn:
                t = dragonn.telemetry
                line += (f" | density {t.achieved_density:.4f} (kept/k {t.kept_over_k:.3f})"
                         f" | sent so far {t.bytes_sent / 1e6:.3f} MB vs dense {t.dense_bytes_equivalent / 1e6:.3f} MB"
                         f" | compress {t.compress_ms_mean:.2f} ms/step (compensate + select + residual) | phases, ms: "
                         + " ".join(f"{k.removesuffix('_ms_mean')} {v:.2f}" for k, v in t.phase_means().items())
                         + f" | {t.compressed_reductions} compressed / {t.dense_reductions} dense")
            acc = test_accuracy(engine, x_te, y_te, device, dtype)
            history.append({"step": step, "test_accuracy": acc, "train_loss": last_loss,
                            "bytes_sent": dragonn.telemetry.bytes_sent if dragonn else None})
            line += f" | test accuracy {acc:.4f}"
            if rank == 0:
                print(line, flush=True)
            loss_sum, loss_n = 0.0, 0

    acc = test_accuracy(engine, x_te, y_te, device, dtype)
    summary = {"task": "classifier", "metric": "test_accuracy", "history": history, "world_size": world, "steps": args.steps, "dragonn_enabled": dragonn is not None,
               "density": dragonn.cfg.density if dragonn else 1.0, "test_accuracy": acc,
               "exchange": dragonn.exchange_name if dragonn else None,
               "zero_stage": int(engine.zero_optimization_stage()),
               "final_loss": last_loss, "wall_s": time.time() - t0,
               **({"hierarchy": hier_dense} if hier_dense else {}),
               "ranks_in_sync": weights_agree(model)}
    finish(summary, dragonn, model, world, rank, f"test_accuracy {acc:.4f} | final_loss {last_loss:.4f}",
           args.summary)


if __name__ == "__main__":
    main()
