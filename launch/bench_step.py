"""Per-phase cost of one compressed allreduce step, everything except the wire, next to the read-pass floor.

One process, world size 1 over gloo on loopback (the exchange is then a local copy, so its time is
the packing and unpacking of the pairs, not the link). The bucket is the link benchmark's model, a
24.2 M-parameter MLP (784-4096-4096-1024-10), as DeepSpeed hands it to ``allreduce_bucket``: the list
of gradient tensors. Per dtype it prints the median ms of each phase over the timed steps, the whole
step until the gradients hold the result (as the engine hook runs it: decoded straight into the
gradients where the CPU library can, else a decode buffer plus DeepSpeed's copy back), one read pass of
the bucket (``g.sum()``, the floor, timed in alternation in the same run), and for context the local
work of DeepSpeed's dense path around its allreduce (flatten, scale, copy back).

    python launch/bench_step.py                      # 1 thread, density 0.01: fp32, bf16 and bf16+txn
    python launch/bench_step.py --json docs/results/step/phases_24m_1thread.json --threads 1 --steps 30 \
        --dtypes fp32,bf16,bf16+txn       # the committed table
"""
from __future__ import annotations

import argparse
import os
import platform

import torch

os.environ.setdefault("DS_DRAGONN_PHASE_TIMING", "1")  # every reduction's phases timed (device-synchronised)
from bench.common import DTYPES, MLP_LAYERS, free_port, median, mlp_shapes, parse_layers, timed_ms, write_json

# -- defaults (units in comments) -----------------------------------------------------------------------
DENSITY = 0.01                        # fraction kept
STEPS = 20                            # timed steps per dtype (after WARMUP)
WARMUP = 3                            # untimed steps (first-use allocations, kernel build)
PHASES = ("compensate_ms", "select_ms", "exchange_ms", "residual_ms", "decode_ms")


def get_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="fp32,bf16,bf16+txn",
                   help="comma-separated: fp32, bf16, fp16; '+txn' = transactional residuals, what fp16 and bf16 "
                        "engines whose steps DeepSpeed may skip on overflow run (check_grad_overflow, the default)")
    p.add_argument("--density", type=float, default=DENSITY)
    p.add_argument("--threads", type=int, default=1, help="torch (and kernel) threads")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--layers", default=",".join(map(str, MLP_LAYERS)), type=parse_layers,
                   help="MLP widths (default: the link benchmark's model)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (world size 1 over gloo or NCCL)")
    p.add_argument("--json", default=None, help="write the records here")
    return p.parse_args()


def make_grads(shapes, dtype, step, device):
    g = torch.Generator().manual_seed(1000 + step)
    # heavy-tailed like real gradients: a few large entries per layer
    return [(torch.randn(s, generator=g) * torch.rand(s, generator=g).pow(4)).to(device=device, dtype=dtype)
            for s in shapes]


def bench_dtype(dtype, shapes, args, backend, transactional=False):
    from ds_dragonn.compress import DragonnCompressor
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.pipeline import CompressedAllreduce

    ef = ErrorFeedback(True, transactional=transactional)
    pipe = CompressedAllreduce(DragonnCompressor(args.density), backend, ef)
    device = torch.device(args.device)
    grads = [make_grads(shapes, dtype, s, device) for s in range(3)]  # rotate 3 inputs: no reuse of a hot cache
    n = sum(g.numel() for g in grads[0])
    flat = torch.cat([g.flatten() for g in grads[0]])
    phases = {p: [] for p in PHASES}
    total, floor, dense_local = [], [], []
    bucket = [g.clone() for g in grads[0]]  # what backward() would have written (refilled, untimed)
    into = pipe.can_reduce_into(bucket, dtype)  # as the engine does: decode into the gradients where it can

    def compressed_step():  # as the engine runs it, until the gradients hold the result
        out, stats = pipe.reduce(bucket, "bucket", seed=step, prescale=1.0, postscale=0.5, dtype=dtype,
                                 into_inputs=into)
        if not into:  # DeepSpeed's allreduce_and_copy copies the flat result into the gradients
            for buf, synced in zip(bucket, torch._utils._unflatten_dense_tensors(out, bucket)):
                buf.copy_(synced)
        ef.end_step(True)  # transactional: the applied step's working buffer becomes the residual (a swap)
        return stats

    def dense_local_work():  # DeepSpeed's dense allreduce_bucket + allreduce_and_copy without the allreduce
        t = torch._utils._flatten_dense_tensors(bucket)
        t.mul_(0.5)
        for buf, synced in zip(bucket, torch._utils._unflatten_dense_tensors(t, bucket)):
            buf.copy_(synced)

    for step in range(WARMUP + args.steps):
        torch._foreach_copy_(bucket, grads[step % 3])
        stats, total_ms = timed_ms(compressed_step, device)
        _, floor_ms = timed_ms(flat.sum, device)
        torch._foreach_copy_(bucket, grads[step % 3])
        _, dense_ms = timed_ms(dense_local_work, device)
        if step >= WARMUP:
            total.append(total_ms)
            floor.append(floor_ms)
            dense_local.append(dense_ms)
            for p in PHASES:
                phases[p].append(getattr(stats, p))
    rec = {"dtype": str(dtype).replace("torch.", "") + ("+txn" if transactional else ""),
           "device": args.device, "transactional": transactional, "selection": "global", "decode_into_gradients": into,
           "numel": n, "density": args.density, "threads": args.threads,
           "steps": args.steps, "kept": stats.kept, "k": stats.k}
    rec.update({p: median(v) for p, v in phases.items()})
    rec["total_ms"] = median(total)
    rec["floor_ms"] = median(floor)
    rec["x_floor"] = rec["total_ms"] / rec["floor_ms"]
    rec["dense_local_ms"] = median(dense_local)
    return rec


def main():
    args = get_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(args.threads)
    import deepspeed
    import torch.distributed as tdist
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo", verbose=False)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress.kernels import cpu_table

    layers = args.layers
    shapes = mlp_shapes(layers)
    records = [bench_dtype(DTYPES[d.split("+")[0]], shapes, args, TorchCommBackend(),
                           transactional="+txn" in d)
               for d in args.dtypes.split(",")]
    tdist.destroy_process_group()

    # CUDA buckets select with the Triton kernel; CPU ones with the C++ table kernel (or the PyTorch reference)
    kernel = "triton" if args.device == "cuda" else (cpu_table.THREADING or "reference")
    print(f"bucket {records[0]['numel']:,} elements (MLP {'-'.join(map(str, layers))}), density {args.density}, "
          f"{args.threads} thread(s), median of {args.steps} steps; kernel {kernel}")
    head = f"{'phase':<28}" + "".join(f"{r['dtype'] + ' ms':>18}" for r in records)
    print(head)
    print("-" * len(head))
    rows = [(p.replace("_ms", ""), p) for p in PHASES] + [
        ("whole step (no wire)", "total_ms"), ("one read pass (floor)", "floor_ms"), ("step / floor", "x_floor"),
        ("dense DeepSpeed local work", "dense_local_ms")]
    for label, key in rows:
        print(f"{label:<28}" + "".join(f"{r[key]:>18.2f}" for r in records))
    if args.json:
        meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                "cpu_threads_available": os.cpu_count()}
        write_json(args.json, {"meta": meta, "records": records})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
