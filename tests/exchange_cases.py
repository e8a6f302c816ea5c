"""Multi-rank cases of the exchange schemes (allgather, partitioned, reduce-scatter): float64 references and
the nothing-lost invariant, for ``tests/test_exchange.py``; executed inside each rank by
``tests.multiproc.run_ranks``."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import init_distributed
from tests.pipeline_cases import case_id, rank_input

SCHEME_SIZES = [0, 1, 5, 1000, 20_011]  # 1 and 5: fewer elements than some owners need; 20_011 prime
SCHEME_CASES = [dict(exchange=x, numel=n, dtype=d, density=dens, compressor=c)
                for x in ("allgather", "partitioned", "reduce_scatter") for n in SCHEME_SIZES
                for d, dens, c in ((torch.float64, 0.01, "dragonn"), (torch.float64, 0.3, "topk"),
                                   (torch.float32, 0.01, "dragonn"), (torch.bfloat16, 0.05, "dragonn"),
                                   (torch.float64, 1.0, "dragonn"))]
# ties everywhere (all ±1): the selection is cut to max_pairs(k) (bounded bytes)
SCHEME_CASES += [dict(exchange=x, numel=n, dtype=torch.float64, density=0.01, compressor="dragonn", ties=True)
                 for x in ("allgather", "partitioned", "reduce_scatter") for n in (1000, 20_011)]
# several 65 536-element chunks: the packed positions' per-chunk counts (exchange/wire.py)
SCHEME_CASES += [dict(exchange=x, numel=150_001, dtype=d, density=dens, compressor="dragonn")
                 for x in ("allgather", "partitioned", "reduce_scatter")
                 for d, dens in ((torch.float32, 0.01), (torch.bfloat16, 0.05))]
SCHEME_STEPS = 4


def scheme_case_id(c: dict) -> str:
    return f"{c['exchange']}-{case_id(c)}{'-ties' if c.get('ties') else ''}"


def make_compressor(name: str, density: float):
    from ds_dragonn.compress import DragonnCompressor
    from launch.bench.baselines import RandomKCompressor, TopKCompressor
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
    init_distributed()
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
