"""Multi-rank cases of the pipeline (compress → exchange → decode → error feedback) over gloo, for
``tests/test_pipeline.py``; executed inside each rank by ``tests.multiproc.run_ranks``."""
from __future__ import annotations

import itertools
from pathlib import Path

import torch

from tests.engines import init_distributed

SIZES = [0, 1, 7, 1000, 65_537, (1 << 20) + 3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EXCHANGE_CASES = [
    dict(numel=n, dtype=d, density=dens, compressor=c)
    for n, d, dens, c in itertools.product(SIZES, DTYPES, [0.01, 1.0], ["dragonn"])
] + [dict(numel=n, dtype=torch.float32, density=0.01, compressor=c)
     for n, c in itertools.product([7, 65_537], ["topk", "randomk"])]
STEPS = 2
SCALE = 0.5  # postscale applied to the decoded sum (1/world_size for 2 ranks)


def case_id(c: dict) -> str:
    return f"{c['compressor']}-n{c['numel']}-{str(c['dtype']).replace('torch.', '')}-d{c['density']}"


def rank_input(case_index: int, rank: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic per (case, rank, step) input; the parent regenerates the same tensors."""
    g = torch.Generator().manual_seed(1_000_003 * case_index + 1009 * rank + step)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g).pow(4)  # heavy-ish tail
    return x.to(dtype)


def exchange_cases(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress import DragonnCompressor
    from launch.bench.baselines import RandomKCompressor, TopKCompressor
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.pipeline import CompressedAllreduce

    backend = TorchCommBackend()
    results = []
    for i, case in enumerate(EXCHANGE_CASES):
        comp = {"dragonn": lambda d: DragonnCompressor(d, min_sample=64), "topk": TopKCompressor,
                "randomk": RandomKCompressor}[case["compressor"]](case["density"])
        ef = ErrorFeedback(True)
        pipe = CompressedAllreduce(comp, backend, ef)
        steps = []
        for step in range(STEPS):
            x = rank_input(i, rank, step, case["numel"], case["dtype"])
            buf = x.clone()
            stats = pipe(buf, key="b", seed=100 + step, postscale=SCALE)
            res = ef.residuals.get("b")
            steps.append(dict(out=buf, residual=None if res is None else res.clone(), stats=stats._asdict()))
        results.append(steps)
    # ranks that disagree on the buffer size must all get the same clear error, not a hang, and the
    # residual must not record pairs as sent that never left
    ef = ErrorFeedback()
    ef.residuals["x"] = torch.full((10 + rank,), 0.25)
    try:
        CompressedAllreduce(DragonnCompressor(0.5), backend, ef)(torch.randn(10 + rank), "x", 0)
        mismatch = None
    except ValueError as err:
        mismatch = str(err)
    residual_kept = bool(torch.equal(ef.residuals["x"], torch.full((10 + rank,), 0.25)))
    torch.save({"results": results, "mismatch": mismatch, "residual_kept": residual_kept},
               Path(out_dir) / f"exchange_rank{rank}.pt")
    torch.distributed.destroy_process_group()
