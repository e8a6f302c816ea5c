"""Multi-rank cases of quantized values on the wire (``advanced.values``: int8, int4) through every exchange
scheme, for ``tests/test_quantize.py``; executed inside each rank by ``tests.multiproc.run_ranks``."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import init_distributed
from tests.exchange_cases import make_compressor, zero_like_ranges
from tests.pipeline_cases import rank_input

# 0, 1, 5 and 63 pairs or fewer (an odd count for int4, a group not full), 1000, a prime, several chunks
QUANT_SIZES = [0, 1, 5, 127, 1000, 20_011, 150_001]
QUANT_CASES = [dict(exchange=x, numel=n, dtype=d, density=dens, values=v)
               for x in ("allgather", "partitioned", "reduce_scatter") for v in ("int8", "int4")
               for n in QUANT_SIZES
               for d, dens in ((torch.float64, 0.05), (torch.bfloat16, 0.05), (torch.float32, 1.0))]
QUANT_STEPS = 4


def quant_case_id(c: dict) -> str:
    return f"{c['exchange']}-{c['values']}-{c['numel']}-{str(c['dtype']).replace('torch.', '')}-{c['density']}"


def quant_input(case_index: int, rank: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic input; a few entries 1000x larger, so that groups span wide ranges."""
    x = rank_input(4241 + case_index, rank, step, numel, torch.float64)
    x[::97] *= 1000.0
    return x.to(dtype)


def _exchange(case: dict, backend, codec):
    from ds_dragonn.exchange import AllgatherExchange, PartitionedExchange
    from ds_dragonn.exchange.reduce_scatter import ReduceScatterExchange
    if case["exchange"] == "partitioned":
        return PartitionedExchange(backend, make_compressor("dragonn", case["density"]), values=codec)
    if case["exchange"] == "reduce_scatter":
        return ReduceScatterExchange(backend, codec)
    return AllgatherExchange(backend, codec)


def quant_cases(rank: int, world: int, out_dir: str) -> None:
    """Every quantized case for QUANT_STEPS steps, each beside the same case with plain values; saves
    outputs, worker and server residuals and statistics; then ranks on different formats."""
    init_distributed()
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress import max_pairs, target_k
    from ds_dragonn.exchange import BufferMismatchError, PLAIN, value_codec
    from ds_dragonn.exchange.reduce_scatter import RangeOwnership
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.pipeline import CompressedAllreduce

    backend = TorchCommBackend()
    results = []
    for i, case in enumerate(QUANT_CASES):
        runs = {}
        for name, codec in (("quant", value_codec(case["values"])), ("plain", PLAIN)):
            ex = _exchange(case, backend, codec)
            ef = ErrorFeedback(True)
            pipe = CompressedAllreduce(make_compressor("dragonn", case["density"]), backend, ef, ex)
            steps = []
            for step in range(QUANT_STEPS):
                x = quant_input(i, rank, step, case["numel"], case["dtype"])
                own = (RangeOwnership(case["numel"], zero_like_ranges(case["numel"], world), world)
                       if case["exchange"] == "reduce_scatter" else None)
                out, stats = pipe.reduce(x, "b", seed=17 * step + 3, postscale=1.0 / world, ownership=own)
                server = getattr(ex, "server", None)
                most = ex.max_bytes(case["numel"], max_pairs(target_k(case["numel"], case["density"])),
                                    case["dtype"], world)
                steps.append(dict(out=out.clone(), residual=ef.residuals["b"].clone(),
                                  server=None if server is None else server.residuals["b"].clone(),
                                  stats=dict(stats._asdict(), max_bytes=most)))
            runs[name] = steps
        results.append(runs)
    # ranks on different value formats: one clear error on every rank, then in sync
    mixed = value_codec("int8") if rank == 0 else PLAIN
    try:
        CompressedAllreduce(make_compressor("dragonn", 0.05), backend, ErrorFeedback(True),
                            _exchange(dict(exchange="allgather"), backend, mixed)).reduce(torch.randn(1000), "m", 1)
        mismatch = None
    except BufferMismatchError as err:
        mismatch = str(err)
    after, _ = CompressedAllreduce(make_compressor("dragonn", 1.0), backend, ErrorFeedback(True)).reduce(
        torch.ones(1000), "ok", 2)
    torch.save({"results": results, "mismatch": mismatch, "after_mismatch": after.clone()},
               Path(out_dir) / f"quant_rank{rank}.pt")
    torch.distributed.destroy_process_group()
