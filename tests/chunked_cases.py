"""Chunk-wise selection (``advanced.selection: chunked``) in real engines and through the exchanges (2 gloo ranks;
run by tests/test_chunked.py): ZeRO 0-3, the partitioned exchange, local steps' Δ, an exact resume, and the
pipeline's float64 invariant."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import engine_config, init_distributed, zero_config
from tests.selection_cases import Quiet

STEPS = 6
#: every engine case: compressed from the first step, chunk-wise (the Quiet model's bucket holds ~5.4 chunks)
CH = {"enabled": True, "density": 0.01, "min_compress_numel": 1, "advanced": {"selection": "chunked"}}
RUNS = {
    "zero0": engine_config(CH),
    "zero0_bf16": engine_config(CH, bf16=True),
    "partitioned": engine_config({**CH, "exchange": "partitioned"}),
    "zero1": zero_config(1, CH, reduce_bucket_size=500_000_000),
    "zero2": zero_config(2, CH),
    "zero3": zero_config(3, CH),
    # each rank keeps its unsent Δ in its weights: "params" is θ_outer there (bit-identical on every rank)
    "local_steps": zero_config(0, {**CH, "sync": "local_steps", "local_steps": 2}),
}


def _batches(rank: int, count: int):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(count)]


def _train(engine, batches) -> None:
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(engine(x.to(next(engine.module.parameters()).dtype)).float(), y)
        engine.backward(loss)
        engine.step()


def _build(cfg: dict):
    import ds_dragonn
    torch.manual_seed(0)
    model = Quiet()
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _params(engine) -> list:
    """The model's weights; under local steps θ_outer (the weights hold each rank's own unsent Δ)."""
    if getattr(engine.dragonn, "outer", None) is not None:
        return [a.detach().float().clone() for a in engine.dragonn.outer.anchor]
    return [p.detach().float().clone() for p in engine.module.parameters()]


def engine_runs(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    out = {}
    batches = _batches(rank, 2 * STEPS)
    for name, cfg in RUNS.items():
        engine = _build(cfg)
        _train(engine, batches[:STEPS])
        hook = engine.dragonn
        out[name] = {"telemetry": hook.telemetry.summary(), "chunk": hook.compressor.chunk, "params": _params(engine)}
        if name == "zero0":
            ckpt = save_and_resume(engine, cfg, batches[STEPS:], out_dir, out)
            other = _build(engine_config({**CH, "advanced": {"selection": "global"}}))  # another selection: kept
            other.load_checkpoint(ckpt, tag="k")
            out["notes"] = list(other.dragonn.notes)
            saved, loaded = _residuals(_loaded(cfg, ckpt)), _residuals(other)
            out["residuals_equal"] = len(saved) == len(loaded) > 0 and all(
                torch.equal(a, b) for a, b in zip(saved, loaded))
    torch.save(out, Path(out_dir) / f"chunked_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def save_and_resume(engine, cfg: dict, rest: list, out_dir: str, out: dict) -> str:
    """Exact resume: save ``engine``, train it on ``rest`` (``out["straight"]``); a fresh engine of ``cfg`` loads the
    checkpoint and trains the same batches (``out["resumed"]``). Returns the checkpoint folder (tag ``"k"``)."""
    ckpt = str(Path(out_dir) / "ckpt")
    engine.save_checkpoint(ckpt, tag="k")
    _train(engine, rest)
    out["straight"] = _params(engine)
    resumed = _build(cfg)
    resumed.load_checkpoint(ckpt, tag="k")
    _train(resumed, rest)
    out["resumed"] = _params(resumed)
    return ckpt


def _loaded(cfg: dict, ckpt: str):
    engine = _build(cfg)
    engine.load_checkpoint(ckpt, tag="k")
    return engine


def _residuals(engine) -> list:
    res = engine.dragonn.error_feedback.residuals
    return [res[key] for key in sorted(res, key=str)]


def exchange_runs(rank: int, world: int, out_dir: str) -> None:
    """Chunk-wise selections through each exchange and the pipeline (fp32 and bf16 wires, a buffer of 3.3 chunks);
    each rank saves its raw buffer, its residual, the decoded sum and what it kept."""
    init_distributed()
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress import DragonnCompressor
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.exchange import build_exchange
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.pipeline import CompressedAllreduce

    n = 3 * 4096 + 1234
    out = {}
    for exchange in ("allgather", "partitioned"):
        for dtype in (torch.float32, torch.bfloat16):
            backend = TorchCommBackend()
            cfg = DragonnConfig(enabled=True, density=0.01, exchange=exchange)
            comp = DragonnCompressor(0.01, chunk=4096)
            pipe = CompressedAllreduce(comp, backend, ErrorFeedback(True), build_exchange(cfg, backend, comp))
            g = torch.Generator().manual_seed(100 + rank)
            x = (torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 2)
            x[4096:8192] *= 1e-3  # a quiet chunk
            x = x.to(dtype)
            res, stats = pipe.reduce([x.clone()], "b", seed=5, dtype=dtype)
            out[(exchange, str(dtype))] = {"x": x, "out": res.clone(), "kept": stats.kept, "k": stats.k,
                                           "residual": pipe.error_feedback.current("b").clone()}
    torch.save(out, Path(out_dir) / f"chunked_exchange_rank{rank}.pt")
    torch.distributed.destroy_process_group()
