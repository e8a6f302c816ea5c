"""The age bound (``advanced.max_age``) through the exchanges and real engines (gloo ranks; run by
tests/test_age_bound.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.chunked_cases import _batches, _build, _params, _train, save_and_resume
from tests.engines import engine_config, init_distributed, zero_config

N = 1001  # not divisible by MAX_AGE nor by the world size
MAX_AGE = 7
STEPS = 6
AGE = {"enabled": True, "density": 0.001, "min_compress_numel": 1, "advanced": {"max_age": 3}}
RUNS = {
    "zero0": engine_config(AGE),
    "zero0_bf16_int4": engine_config({**AGE, "advanced": {"max_age": 3, "values": "int4"}}, bf16=True),
    "partitioned": engine_config({**AGE, "exchange": "partitioned"}),
    "zero2": zero_config(2, AGE),
    "zero3": zero_config(3, AGE),
    "local_steps": zero_config(0, {**AGE, "sync": "local_steps", "local_steps": 2}),
}


def exchange_runs(rank: int, world: int, out_dir: str) -> None:
    """One bucket of N elements, a gradient at step 0 only, then MAX_AGE steps of zero gradients at density 0.001
    (k = 1): with the bound every entry has left the residual by then. Saves, per (exchange, dtype, values, bound),
    the gradient, the decoded outputs' sum, the final residual and the bytes of step 1."""
    init_distributed()
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress import DragonnCompressor
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.exchange import build_exchange
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.pipeline import CompressedAllreduce

    out = {}
    for exchange in ("allgather", "partitioned"):
        for dtype in (torch.float32, torch.bfloat16):
            for values in ("auto", "int4"):
                for bound in (0, MAX_AGE):
                    backend = TorchCommBackend()
                    cfg = DragonnConfig(enabled=True, density=0.001, exchange=exchange, advanced={"values": values})
                    comp = DragonnCompressor(0.001)
                    pipe = CompressedAllreduce(comp, backend, ErrorFeedback(True), build_exchange(cfg, backend, comp),
                                               max_age=bound)
                    g = torch.Generator().manual_seed(100 + rank)
                    x = (torch.randn(N, generator=g) * torch.rand(N, generator=g) ** 2).to(dtype)
                    total = torch.zeros(N, dtype=torch.float64)
                    sent = []
                    for step in range(MAX_AGE + 1):
                        grad = x.clone() if step == 0 else torch.zeros_like(x)
                        res, stats = pipe.reduce([grad], "b", seed=5 + step, dtype=dtype, age_step=step)
                        total += res.double()
                        sent.append(stats.bytes_sent)
                    out[(exchange, str(dtype), values, bound)] = {
                        "x": x, "total": total, "residual": pipe.error_feedback.current("b").clone(), "sent": sent}
    torch.save(out, Path(out_dir) / f"age_exchange_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def engine_runs(rank: int, world: int, out_dir: str) -> None:
    """Each :data:`RUNS` config for STEPS steps; ZeRO 0 also saves, resumes and trains on (exact resume)."""
    init_distributed()
    out = {}
    batches = _batches(rank, 2 * STEPS)
    for name, cfg in RUNS.items():
        engine = _build(cfg)
        _train(engine, batches[:STEPS])
        out[name] = {"telemetry": engine.dragonn.telemetry.summary(), "params": _params(engine),
                     "max_age": engine.dragonn.cfg.max_age}
        if name == "zero0":
            save_and_resume(engine, cfg, batches[STEPS:], out_dir, out)
    torch.save(out, Path(out_dir) / f"age_rank{rank}.pt")
    torch.distributed.destroy_process_group()
