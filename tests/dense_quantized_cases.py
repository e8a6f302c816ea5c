"""Multi-rank cases of the quantized dense allreduce (``advanced.dense_values``: int8 / int4), for
``tests/test_dense_quantized.py``; executed inside each rank by ``tests.multiproc.run_ranks``."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import engine_config, init_distributed, train_mlp, zero_config

# 0, 1 and 2 elements (fewer than the ranks: empty shards), a group not full, one full group and one more,
# not divisible by 2 or 3, several groups per shard
DQ_SIZES = [0, 1, 2, 63, 64, 65, 1001, 20_011]
DQ_CASES = [dict(numel=n, values=v, dtype=d) for v in ("int8", "int4") for n in DQ_SIZES
            for d in (torch.float32, torch.bfloat16)]
DQ_STEPS = 3
#: engine runs: ZeRO 0, SGD (an update proportional to the gradient, so the weights show the rounding's size);
#: every step dense (a 100-step warm-up), DeepSpeed's allreduce or quantized; then Adam, in the momentum mode with a
#: quantized warm-up and a variance refresh, and in the gradient mode in bf16
DQ_ENGINE_STEPS = 6
_ALL_DENSE = {"enabled": True, "warmup_steps": 100, "density": 0.1}
DQ_ENGINE_RUNS = {
    "dense": engine_config(None),
    "warmup_auto": engine_config({**_ALL_DENSE, "advanced": {"dense_values": "dtype"}}),
    "warmup_int8": engine_config({**_ALL_DENSE, "advanced": {"dense_values": "int8"}}),
    "warmup_int4": engine_config({**_ALL_DENSE, "advanced": {"dense_values": "int4"}}),
    "momentum_int8": zero_config(0, {"enabled": True, "warmup_steps": 2, "density": 0.1, "compress": "momentum",
                                     "advanced": {"dense_values": "int8", "variance_refresh_steps": 2}}),
    "gradient_int4_bf16": zero_config(0, {"enabled": True, "warmup_steps": 2, "density": 0.1, "compress": "gradient",
                                          "advanced": {"dense_values": "int4"}}, bf16=True),
}


def dq_input(case_index: int, rank: int, step: int, numel: int) -> torch.Tensor:
    """Deterministic float64 input; every 97th entry 1000x larger (groups spanning wide ranges)."""
    g = torch.Generator().manual_seed(7919 * case_index + 131 * rank + step)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    x[::97] *= 1000.0
    return x


def dq_cases(rank: int, world: int, out_dir: str) -> None:
    """Every case for DQ_STEPS steps through ``CompressedAllreduce.reduce_dense`` with a quantized codec (error
    feedback on), then one step holding a NaN on rank 0, then the engine runs."""
    init_distributed()
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from launch.bench.baselines import TopKCompressor
    from ds_dragonn.exchange import value_codec
    from ds_dragonn.exchange.dense_quantized import quantized_allreduce
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.pipeline import CompressedAllreduce

    backend = TorchCommBackend()
    results = []
    for i, case in enumerate(DQ_CASES):
        codec = value_codec(case["values"])
        ef = ErrorFeedback(True)
        pipe = CompressedAllreduce(TopKCompressor(0.1), backend, ef)
        steps = []
        for step in range(DQ_STEPS):
            x = dq_input(i, rank, step, case["numel"]).to(case["dtype"])
            out = pipe.reduce_dense([x], "b", 1.0, 1.0, case["dtype"], codec, raw=True)
            red = quantized_allreduce(x.float(), backend, codec)  # the bytes of one such reduction
            steps.append(dict(x=x.clone(), out=out.clone(), residual=ef.residuals["b"].clone(),
                              bytes_sent=red.bytes_sent))
        results.append(steps)
    # a NaN on rank 0: every rank decodes its group as NaN, no residual keeps it
    ef = ErrorFeedback(True)
    x = dq_input(99, rank, 0, 1000).float()
    if rank == 0:
        x[130] = float("nan")
    nan_out = CompressedAllreduce(TopKCompressor(0.1), backend, ef).reduce_dense([x], "n", 1.0, 1.0, torch.float32,
                                                                                value_codec("int8"), raw=True)
    engines = {}
    for name, cfg in DQ_ENGINE_RUNS.items():
        engine, hook = train_mlp(cfg, rank, (40, 30, 10), DQ_ENGINE_STEPS)
        engines[name] = {"params": [p.detach().float().clone() for p in engine.module.parameters()],
                         "telemetry": None if hook is None else hook.telemetry.summary(),
                         "refreshed": 0 if hook is None or hook.variance_freeze is None
                         else hook.variance_freeze.refreshed,
                         "residual_hooks": [] if hook is None else
                         sorted(getattr(k, "hook", "?") for k in hook.error_feedback.residuals)}
    # a 4-element model: the quantized step's scales and alignment would cost more, so DeepSpeed's allreduce
    engine, hook = train_mlp(DQ_ENGINE_RUNS["warmup_int8"], rank, (1, 1, 1), 3)
    engines["tiny_int8"] = {"params": [p.detach().float().clone() for p in engine.module.parameters()],
                            "telemetry": hook.telemetry.summary(), "refreshed": 0}
    engine, _ = train_mlp(DQ_ENGINE_RUNS["dense"], rank, (1, 1, 1), 3)
    engines["tiny_dense"] = {"params": [p.detach().float().clone() for p in engine.module.parameters()]}
    torch.save({"results": results, "nan_out": nan_out.clone(), "nan_residual": ef.residuals["n"].clone(),
                "engines": engines}, Path(out_dir) / f"dq_rank{rank}.pt")
    torch.distributed.destroy_process_group()
