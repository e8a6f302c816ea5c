"""Functions executed inside each rank by ``tests.multiproc.run_ranks`` (not collected by pytest)."""
from __future__ import annotations

import itertools
from pathlib import Path

import torch

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


def _init():
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def exchange_cases(rank: int, world: int, out_dir: str) -> None:
    _init()
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress import DragonnCompressor, RandomKCompressor, TopKCompressor
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


# -- engine -------------------------------------------------------------------------------------------
#: The engine tests run a few steps of tiny models: no warm-ups (compressed from the first step, at the density
#: under test, unless a test sets warmup_steps), and per-tensor selection with every tensor compressed (none
#: sent whole), so that the per-tensor path runs in every engine test. tests/test_selection.py covers the
#: defaults and global selection.
PINNED = {"warmup_steps": 0, "density_warmup_steps": 0, "selection": "per_tensor", "tensor_min_compress_numel": 0,
          "compress_1d": True}


def pinned(dragonn: dict) -> dict:
    """:data:`PINNED`, with global selection for the partitioned exchange (per-tensor selection is refused
    there: its owners re-select globally)."""
    return {**PINNED, "selection": "global"} if dragonn.get("exchange") == "partitioned" else PINNED


def _engine_config(dragonn: dict | None, bf16: bool = False, predivide: float | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
           "zero_optimization": {"stage": 0}, "steps_per_print": 10**6}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if predivide is not None:
        cfg["gradient_predivide_factor"] = predivide
    if dragonn is not None:
        cfg["dragonn"] = {"policy": "always", **pinned(dragonn), **dragonn}
    return cfg


ENGINE_RUNS = {
    "dense": _engine_config(None),
    "dragonn_d1": _engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1}),
    "dragonn_d1_partitioned": _engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1,
                                              "exchange": "partitioned"}),
    "dragonn_d001_partitioned": _engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1,
                                                "exchange": "partitioned"}),
    "dragonn_d1_predivide": _engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1}, predivide=2.0),
    "dense_predivide": _engine_config(None, predivide=2.0),
    "dragonn_d001": _engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1}),
    "dragonn_warmup": _engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1,
                                      "warmup_steps": 3}),
    "dragonn_disabled": _engine_config({"enabled": False, "density": 0.01}),
    "dense_bf16": _engine_config(None, bf16=True),
    # auto policy: 1 dense probe, 1 compressed probe, then a decision the ranks agree on (timing-dependent)
    # DeepSpeed's csv monitor (output_path set per run below); warm-up marks the switch
    "dragonn_monitor": {**_engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1,
                                          "warmup_steps": 2}),
                        "csv_monitor": {"enabled": True, "job_name": "mon"}},
    "dragonn_auto": _engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1, "policy": "auto",
                                    "auto_probe_steps": 1, "auto_recheck_interval": 2}),
    "dragonn_bf16": _engine_config({"enabled": True, "density": 0.05, "min_compress_numel": 1}, bf16=True),
    # bf16 pairs cost 6 bytes against 2 dense: at density 1.0 the auto policy sends the bucket dense,
    # "always" compresses it anyway (bounded bytes)
    "dragonn_bf16_d1_auto": _engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1,
                                            "policy": "auto"}, bf16=True),
    "dragonn_bf16_d1_always": _engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1}, bf16=True),
}
ENGINE_STEPS = 5


def train_mlp(cfg: dict, rank: int, layers: tuple, steps: int):
    """A seeded MLP ``layers[0] -> layers[1] (tanh) -> layers[2]`` through ``ds_dragonn.initialize`` and
    ``steps`` micro steps of 8 random samples (the rank's own stream); returns (engine, its DRAGONN hook or None)."""
    import ds_dragonn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(layers[0], layers[1]), torch.nn.Tanh(),
                                torch.nn.Linear(layers[1], layers[2]))
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dtype = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(8, layers[0], generator=g).to(dtype)
        y = torch.randint(0, layers[2], (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
    return engine, getattr(engine, "dragonn", None)


def engine_runs(rank: int, world: int, out_dir: str) -> None:
    _init()
    import ds_dragonn

    out = {}
    for name, cfg in ENGINE_RUNS.items():
        if "csv_monitor" in cfg:
            cfg = {**cfg, "csv_monitor": {**cfg["csv_monitor"], "output_path": str(Path(out_dir) / "csv")}}
        engine, hook = train_mlp(cfg, rank, (32, 64, 4), ENGINE_STEPS)
        out[name] = {"params": [p.detach().float().clone() for p in engine.module.parameters()],
                     "telemetry": hook.telemetry.summary() if hook else None,
                     "hooked": hook is not None and engine.allreduce_bucket == hook.allreduce_bucket}
    # frozen layers that take turns: b's true gradient is 0, a's residual must never reach b
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(10, 10, bias=False), "b": torch.nn.Linear(10, 10, bias=False)})
    cfg = _engine_config({"enabled": True, "density": 0.1, "min_compress_numel": 1})
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.0}}  # steps advance, weights stay
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    b_grads = []
    for step in range(6):
        train_a = step % 2 == 0
        model["a"].weight.requires_grad_(train_a)
        model["b"].weight.requires_grad_(not train_a)
        x = torch.ones(4, 10)
        loss = engine.module["a"](x).sum() * 100 + engine.module["b"](x).sum() * 0
        engine.backward(loss)
        if not train_a:
            b_grads.append(float(model["b"].weight.grad.abs().max()))
        engine.step()
    out["frozen_b_grads"] = b_grads
    # the pipeline engine is refused at initialize
    from deepspeed.pipe import PipelineModule
    pipe = PipelineModule(layers=[torch.nn.Linear(4, 4)], num_stages=1)
    try:
        ds_dragonn.initialize(model=pipe, model_parameters=pipe.parameters(),
                              config=_engine_config({"enabled": True}))
        out["pipeline_error"] = None
    except ds_dragonn.DragonnUnsupportedError as err:
        out["pipeline_error"] = str(err)
    torch.save(out, Path(out_dir) / f"engine_rank{rank}.pt")
    torch.distributed.destroy_process_group()


# -- exchange schemes: allgather vs partitioned, float64 references and the nothing-lost invariant ------
SCHEME_SIZES = [0, 1, 5, 1000, 20_011]  # 1 and 5: fewer elements than some owners need; 20_011 prime
SCHEME_CASES = [dict(exchange=x, numel=n, dtype=d, density=dens, compressor=c)
                for x in ("allgather", "partitioned", "reduce_scatter") for n in SCHEME_SIZES
                for d, dens, c in ((torch.float64, 0.01, "dragonn"), (torch.float64, 0.3, "topk"),
                                   (torch.float32, 0.01, "dragonn"), (torch.bfloat16, 0.05, "dragonn"),
                                   (torch.float64, 1.0, "dragonn"))]
# ties everywhere (all ±1): the selection is cut to max_pairs(k) (bounded bytes)
SCHEME_CASES += [dict(exchange=x, numel=n, dtype=torch.float64, density=0.01, compressor="dragonn", ties=True)
                 for x in ("allgather", "partitioned", "reduce_scatter") for n in (1000, 20_011)]
SCHEME_STEPS = 4


def scheme_case_id(c: dict) -> str:
    return f"{c['exchange']}-{case_id(c)}{'-ties' if c.get('ties') else ''}"


def make_compressor(name: str, density: float):
    from ds_dragonn.compress import DragonnCompressor, RandomKCompressor, TopKCompressor
    return {"dragonn": lambda: DragonnCompressor(density, min_sample=64), "topk": lambda: TopKCompressor(density),
            "randomk": lambda: RandomKCompressor(density)}[name]()


def scheme_input(case_index: int, rank: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    x = rank_input(7919 + case_index, rank, step, numel, dtype)
    return torch.where(x < 0, -1.0, 1.0).to(dtype) if SCHEME_CASES[case_index].get("ties") else x


def zero_like_ranges(numel: int, world: int, seed: int = 3) -> list:
    """(start, length, owner) slices covering [0, numel), owners in no particular order (like ZeRO's)."""
    g = torch.Generator().manual_seed(seed + numel)
    cuts = sorted(set(torch.randint(0, max(numel, 1), (6,), generator=g).tolist()) | {0, numel})
    return [(a, b - a, int(torch.randint(0, world, (1,), generator=g))) for a, b in zip(cuts, cuts[1:])]


def fp16_limit_input(case: int, rank: int, numel: int = 1000) -> torch.Tensor:
    """fp16 values whose sum over ranks exceeds 65504 though the mean does not: case 0 all 30000.0; case 1
    magnitudes in [30000, 65504] with the same sign on every rank (so the mean is large too)."""
    if case == 0:
        return torch.full((numel,), 30000.0, dtype=torch.float16)
    g = torch.Generator().manual_seed(77 + rank)
    sign = torch.where(torch.arange(numel) % 3 == 0, -1.0, 1.0)
    return (sign * (30000.0 + 35504.0 * torch.rand(numel, generator=g))).to(torch.float16)


def fp16_near_limit(exchange: str, rank: int, world: int) -> list:
    """Density-1.0 reductions of :func:`fp16_limit_input` (cases 0, 1) with ``exchange``, averaged over ranks."""
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.exchange import AllgatherExchange, PartitionedExchange
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.pipeline import CompressedAllreduce
    backend = TorchCommBackend()
    ex = PartitionedExchange(backend, make_compressor("dragonn", 1.0)) if exchange == "partitioned" \
        else AllgatherExchange(backend)
    pipe = CompressedAllreduce(make_compressor("dragonn", 1.0), backend, ErrorFeedback(True), ex)
    return [pipe.reduce(fp16_limit_input(c, rank), f"fp16_{c}", seed=3, postscale=1.0 / world).out for c in (0, 1)]


def scheme_cases(rank: int, world: int, out_dir: str) -> None:
    """Every scheme case for SCHEME_STEPS steps; saves outputs, worker and server residuals, statistics."""
    _init()
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress import max_pairs, target_k
    from ds_dragonn.exchange import AllgatherExchange, PartitionedExchange
    from ds_dragonn.exchange.reduce_scatter import RangeOwnership, ReduceScatterExchange
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.pipeline import CompressedAllreduce

    backend = TorchCommBackend()
    results = []
    for i, case in enumerate(SCHEME_CASES):
        comp = make_compressor(case["compressor"], case["density"])
        if case["exchange"] == "partitioned":
            ex = PartitionedExchange(backend, make_compressor(case["compressor"], case["density"]))
        elif case["exchange"] == "reduce_scatter":
            ex = ReduceScatterExchange(backend)
        else:
            ex = AllgatherExchange(backend)
        ef = ErrorFeedback(True)
        pipe = CompressedAllreduce(comp, backend, ef, ex)
        steps = []
        for step in range(SCHEME_STEPS):
            x = scheme_input(i, rank, step, case["numel"], case["dtype"])
            own = (RangeOwnership(case["numel"], zero_like_ranges(case["numel"], world), world)
                   if case["exchange"] == "reduce_scatter" else None)
            out, stats = pipe.reduce(x, "b", seed=31 * step + 5, postscale=1.0 / world, ownership=own)
            server = getattr(ex, "server", None)
            most = ex.max_bytes(case["numel"], max_pairs(target_k(case["numel"], case["density"])), case["dtype"],
                                world)
            steps.append(dict(out=out.clone(), residual=ef.residuals["b"].clone(),
                              server=None if server is None else server.residuals["b"].clone(),
                              stats=dict(stats._asdict(), max_bytes=most)))
        if case["dtype"] == torch.float64:  # then the bucket goes dense (auto policy): a flush step
            x = scheme_input(i, rank, SCHEME_STEPS, case["numel"], case["dtype"])
            out = pipe.reduce_dense([x], "b", postscale=1.0 / world)
            steps.append(dict(out=out, residual=ef.residuals["b"].clone(),
                              server=None if server is None else server.residuals["b"].clone()))
        results.append(steps)
    fp16_limit = {x: [out.clone() for out in fp16_near_limit(x, rank, world)] for x in ("allgather", "partitioned")}
    # ranks configured with different exchange schemes: one clear error on every rank, then in sync
    from ds_dragonn.exchange import BufferMismatchError
    mixed = PartitionedExchange(backend, make_compressor("dragonn", 0.01)) if rank == 0 else AllgatherExchange(backend)
    try:
        CompressedAllreduce(make_compressor("dragonn", 0.01), backend, ErrorFeedback(True), mixed).reduce(
            torch.randn(1000), "m", 1)
        mismatch = None
    except BufferMismatchError as err:
        mismatch = str(err)
    after, _ = CompressedAllreduce(make_compressor("dragonn", 1.0), backend, ErrorFeedback(True)).reduce(
        torch.ones(1000), "ok", 2)
    torch.save({"results": results, "scheme_mismatch": mismatch, "after_mismatch": after.clone(),
                "fp16_limit": fp16_limit}, Path(out_dir) / f"scheme_rank{rank}.pt")
    torch.distributed.destroy_process_group()


# -- ZeRO stage 1/2 -------------------------------------------------------------------------------------
def _zero_config(stage: int, dragonn: dict | None, bf16: bool = False, gas: int = 1, **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 6000, **zero}, "steps_per_print": 10**6}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if dragonn is not None:
        cfg["dragonn"] = {"policy": "always", "min_compress_numel": 1, **pinned(dragonn), **dragonn}
    return cfg


ZERO_RUNS = {f"s{stage}_{prec}_{name}": _zero_config(stage, d, bf16=prec == "bf16")
             for stage in (1, 2) for prec in ("fp32", "bf16")
             for name, d in (("dense", None), ("d1", {"enabled": True, "density": 1.0}),
                             ("d001", {"enabled": True, "density": 0.01}))}
ZERO_RUNS.update({
    "s2_fp32_gas2_dense": _zero_config(2, None, gas=2),
    "s2_fp32_gas2_d1": _zero_config(2, {"enabled": True, "density": 1.0}, gas=2),
    "s2_fp32_gas2_d001": _zero_config(2, {"enabled": True, "density": 0.01}, gas=2),
    "s2_fp32_warmup": _zero_config(2, {"enabled": True, "density": 0.01, "warmup_steps": 2}),
    "s2_fp32_overlap_dense": _zero_config(2, None, overlap_comm=True),
    "s2_fp32_overlap_d1": _zero_config(2, {"enabled": True, "density": 1.0}, overlap_comm=True),
    "s1_fp32_no_multi_rank_dense": _zero_config(1, None, use_multi_rank_bucket_allreduce=False),
    "s1_fp32_no_multi_rank_d1": _zero_config(1, {"enabled": True, "density": 1.0},
                                             use_multi_rank_bucket_allreduce=False),
})
for _name, _d in (("dense", None), ("d1", {"enabled": True, "density": 1.0})):
    # bf16 parameters with fp32 gradient accumulation: ZeRO keeps a compact fp32 gradient partition
    ZERO_RUNS[f"s2_bf16_accfp32_{_name}"] = {**_zero_config(2, _d, bf16=True), "data_types": {"grad_accum_dtype": "fp32"}}
    # fp32 gradients reduced in bf16; error feedback off, else the residual would (rightly) carry the bf16
    # rounding of every value into the next step, which the dense path drops
    _d = None if _d is None else {**_d, "error_feedback": False}
    ZERO_RUNS[f"s2_fp32_commbf16_{_name}"] = {**_zero_config(2, _d), "communication_data_type": "bf16"}
ZERO_REFUSED = {
    "stage3": _zero_config(3, {"enabled": True}),
    "no_reduce_scatter": _zero_config(2, {"enabled": True}, reduce_scatter=False),
    "offload": _zero_config(2, {"enabled": True}, offload_optimizer={"device": "cpu"}),
    "not_contiguous": _zero_config(2, {"enabled": True}, contiguous_gradients=False),
}
ZERO_STEPS = 4
ZERO_LAYERS = (64, 256, 10)  # 19,210 parameters: several IPG buckets of 6000 elements


def zero_runs(rank: int, world: int, out_dir: str) -> None:
    _init()
    import ds_dragonn

    out = {}
    for name, cfg in ZERO_RUNS.items():
        engine, hook = train_mlp(cfg, rank, ZERO_LAYERS, ZERO_STEPS * cfg["gradient_accumulation_steps"])
        out[name] = {"params": [p.detach().float().clone() for p in engine.module.parameters()],
                     "telemetry": hook.telemetry.summary() if hook else None,
                     "hooked": hook is not None and engine.optimizer.average_tensor == hook.average_tensor}
    for name, cfg in ZERO_REFUSED.items():
        model = torch.nn.Linear(4, 4)
        try:
            ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            out[name] = None
        except ds_dragonn.DragonnUnsupportedError as err:
            out[name] = str(err)
    torch.save(out, Path(out_dir) / f"zero_rank{rank}.pt")
    torch.distributed.destroy_process_group()


# -- ranks that disagree on the "dragonn" block -----------------------------------------------------------
DISAGREE = {  # name -> per-rank "dragonn" blocks (rank r takes entry r % 2)
    "enabled": [{"enabled": True, "density": 0.01}, {"enabled": False, "density": 0.01}],
    "min_compress_numel": [{"enabled": True, "min_compress_numel": 1}, {"enabled": True, "min_compress_numel": 10**9}],
    "warmup_steps": [{"enabled": True, "warmup_steps": 0}, {"enabled": True, "warmup_steps": 3}],
    "zero_stage": [{"enabled": True}, {"enabled": True}],  # stage 0 on rank 0, stage 2 on the others
    "gradient_accumulation_steps": [{"enabled": True}, {"enabled": True}],  # 1 on rank 0, 2 on the others
}
REFUSED_ON_ONE_RANK = {  # rank 0 fine, the others refuse: every rank must stop at once, none may hang
    "invalid_key": [{"enabled": True}, {"enabled": True, "densty": 0.1}],
    "offload": [{"enabled": True}, {"enabled": True}],  # offload_optimizer on ranks >= 1
}
AGREE_ANYWAY = {  # differences that change no collective: no error
    "log_interval": [{"enabled": True, "min_compress_numel": 1, "log_interval": 0},
                     {"enabled": True, "min_compress_numel": 1, "log_interval": 5}],
    "all_disabled": [{"enabled": False, "density": 0.5}, None],
}


def disagree_runs(rank: int, world: int, out_dir: str) -> None:
    """Each case: every rank must raise at initialize (a hang fails by timeout), or none for AGREE_ANYWAY."""
    _init()
    import time
    import ds_dragonn

    out = {}
    cases = {**DISAGREE, **REFUSED_ON_ONE_RANK, **AGREE_ANYWAY}
    for name, blocks in cases.items():
        block = blocks[min(rank, 1)]
        cfg = _engine_config(block) if block is not None else _engine_config(None)
        if block is not None and "densty" in block:
            cfg["dragonn"] = dict(block)
        if name == "gradient_accumulation_steps" and rank > 0:
            cfg["gradient_accumulation_steps"] = 2
        if (name == "zero_stage" or name == "offload") and rank > 0:
            cfg["zero_optimization"] = {"stage": 2}
            cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}
            if name == "offload":
                cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        model = torch.nn.Linear(8, 4)
        t0 = time.monotonic()
        try:
            ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            out[name] = (None, None, time.monotonic() - t0)
        except (ds_dragonn.DragonnConfigError, ds_dragonn.DragonnUnsupportedError) as err:
            out[name] = (type(err).__name__, str(err), time.monotonic() - t0)
    # and ranks that agree still train (the check is one collective at initialize)
    model = torch.nn.Linear(8, 4)
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(),
                                       config=_engine_config({"enabled": True, "min_compress_numel": 1}))
    engine.backward(engine(torch.randn(8, 8)).sum())
    engine.step()
    out["agree_compressed"] = engine.dragonn.telemetry.compressed_reductions
    # ranks that froze different layers of the same size: same bucket length, other parameters
    from ds_dragonn.exchange import BufferMismatchError
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(10, 10, bias=False), "b": torch.nn.Linear(10, 10, bias=False)})
    model["b" if rank == 0 else "a"].weight.requires_grad_(False)
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(),
                                       config=_engine_config({"enabled": True, "min_compress_numel": 1}))
    try:
        engine.backward((engine.module["a"](torch.ones(2, 10)) + engine.module["b"](torch.ones(2, 10))).sum())
        engine.step()
        out["layout_mismatch"] = None
    except BufferMismatchError as err:
        out["layout_mismatch"] = str(err)
    torch.save(out, Path(out_dir) / f"disagree_rank{rank}.pt")
    torch.distributed.destroy_process_group()
