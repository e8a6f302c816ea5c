"""Read-backs of a CUDA device per compressed bucket, counted on CPU.

Every call from ``ds_dragonn/`` that would make a CUDA device wait for the host (``item``, ``tolist``,
``nonzero``, ``__bool__``/``__int__``/``__float__``, ``.cpu()``, ``torch.cuda.synchronize``) is counted while
one compressed reduction runs, after a warm-up, over every exchange (``tests/syncs_harness.py``: ranks that
mirror this one, in-process). The CPU library's wrappers (``compress/kernels/cpu_table.py``) are not
counted: they never run on a CUDA tensor.
"""
from __future__ import annotations

import pytest
import torch

from ds_dragonn import pipeline
from ds_dragonn.compress import DragonnCompressor
from ds_dragonn.exchange import AllgatherExchange, PartitionedExchange
from ds_dragonn.exchange.reduce_scatter import RangeOwnership, ReduceScatterExchange
from ds_dragonn.feedback import ErrorFeedback
from ds_dragonn.pipeline import CompressedAllreduce, PhaseClock
from tests.syncs_harness import count_syncs, mirrored

# the most read-backs per compressed bucket: the counts header that sizes the payload (allgather, and
# ZeRO 1/2/3's reduce-scatter), plus the owners' counts header (partitioned)
LIMITS = {"allgather": 1, "partitioned": 2, "reduce_scatter": 1}


class CudaClock(PhaseClock):
    """A phase clock that believes its device is CUDA (its synchronize calls are counted, not run)."""

    def __init__(self, device, timed=None):
        super().__init__(torch.device("cuda"), timed)


def _exchange(name, backend, n, world):
    if name == "allgather":
        return AllgatherExchange(backend), None
    if name == "partitioned":
        return PartitionedExchange(backend, DragonnCompressor(0.01)), None
    half = n // world
    return ReduceScatterExchange(backend), RangeOwnership(n, [(0, half, 0), (half, n - half, 1)], world)


def counted_reduction(name: str, dtype: torch.dtype, n: int = 50_001, world: int = 2, nonfinite: bool = False):
    """The read-backs of the third compressed reduction of one bucket (``Counter`` of ``file:line method``)."""
    with mirrored(world) as backend:
        ex, own = _exchange(name, backend, n, world)
        pipe = CompressedAllreduce(DragonnCompressor(0.01), backend, ErrorFeedback(True), ex)
        g = torch.Generator().manual_seed(7)
        for step in range(3):
            x = torch.randn(n, generator=g).to(dtype)
            if nonfinite and step == 2:
                x[123] = float("inf")
            if step < 2:
                pipe.reduce(x, "b", 100 + step, postscale=0.5, dtype=dtype, ownership=own)
                continue
            with count_syncs() as counts:
                out = pipe.reduce(x, "b", 100 + step, postscale=0.5, dtype=dtype, ownership=own)
        return counts, out, pipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(LIMITS))
def test_read_backs_per_bucket(monkeypatch, name, dtype):
    monkeypatch.setattr(pipeline, "PhaseClock", CudaClock)
    pipeline.request_timing(False)
    counts, _, _ = counted_reduction(name, dtype)
    total = sum(counts.values())
    assert total <= LIMITS[name], f"{name}: {total} read-backs per bucket: {dict(counts)}"
    assert not any("synchronize" in k for k in counts), dict(counts)


def test_phase_clock_syncs_only_when_timing_is_asked(monkeypatch):
    monkeypatch.setattr(pipeline, "PhaseClock", CudaClock)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # the warm-up's (not counted)
    pipeline.request_timing(True)
    try:
        counts, out, _ = counted_reduction("allgather", torch.float32)
    finally:
        pipeline.request_timing(False)
    assert sum(v for k, v in counts.items() if "synchronize" in k) == 6  # the first mark and five laps
    assert out.stats.timed
    monkeypatch.undo()
    counts, out, _ = counted_reduction("allgather", torch.float32)
    assert out.stats.timed  # a CPU clock always reads the device's time, without a sync
    assert not any("synchronize" in k for k in counts)


def test_untimed_cuda_clock_reports_zero():
    clock = PhaseClock(torch.device("cuda"), timed=False)
    assert clock.lap() == 0.0 and not clock.timed


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_nonfinite_buffer_is_cleared_without_extra_read_back(name):
    """An Inf in the bucket is sent (it ranks first); the flag in the header then triggers the residual's
    non-finite pass, and no residual entry stays non-finite."""
    counts, _, pipe = counted_reduction(name, torch.float32, nonfinite=True)
    assert sum(counts.values()) <= LIMITS[name], dict(counts)
    res = pipe.error_feedback.residuals["b"]
    assert bool(torch.isfinite(res).all())


def test_decode_still_rejects_out_of_range_indices():
    from ds_dragonn.decode import SparseDecoder
    with pytest.raises(ValueError, match="outside the bucket"):
        SparseDecoder().decode("k", 10, [torch.tensor([0, 10])], [torch.ones(2)], torch.float32,
                               torch.device("cpu"))


# -- one training step per ZeRO stage (2 gloo ranks) ------------------------------------------------------
from tests.multiproc import ranks_fixture  # noqa: E402
from tests.syncs_cases import RUNS  # noqa: E402

#: read-backs per compressed bucket of a whole step (the per-step ones included: one bucket per step)
ENGINE_LIMITS = {"zero0_allgather": 1, "zero0_partitioned": 2, "zero1": 2, "zero2": 2, "zero3": 2,
                 "zero0_momentum": 1, "zero2_momentum": 2}
engine_runs = ranks_fixture("tests.syncs_cases:engine_syncs", "syncs", timeout=400)


@pytest.mark.parametrize("name", list(RUNS))
def test_engine_read_backs_per_bucket(engine_runs, name):
    for rank in engine_runs:
        run = rank[name]
        assert run["reductions"] >= 1, f"{name}: no compressed reduction in the counted step"
        assert run["frozen"] or "momentum" not in name, f"{name}: Adam's variance never frozen"
        per_bucket = sum(run["counts"].values()) / run["reductions"]
        assert per_bucket <= ENGINE_LIMITS[name], f"{name}: {per_bucket} per bucket: {run['counts']}"


def test_gpu_scripts_dry_run(tmp_path):
    """``launch/gpu_check.sh``'s Python parts run on CPU (``--dry-run``) and write their records."""
    import json
    from tests.gpu import sync_count, user_cost
    assert user_cost.main(["--dry-run", "--outdir", str(tmp_path), "--parts", "step_cost", "syncs"]) == 0
    syncs = json.loads((tmp_path / "syncs.json").read_text())["records"]
    assert {r["exchange"]: r["instrumented"] for r in syncs} == {"allgather": 1, "partitioned": 2, "reduce_scatter": 1}
    assert len(json.loads((tmp_path / "step_cost.json").read_text())["records"]) == 2
    sync_count.main(["--dry-run", "--out", str(tmp_path / "s.json")])
    assert [r["syncs"] for r in json.loads((tmp_path / "s.json").read_text())["records"]] == [1, 2, 1]


def test_triton_selection_read_backs(tmp_path):
    """The CUDA selection path (the Triton kernels, interpreted on CPU): the compaction of the hash table into
    pairs (``table[table != EMPTY_SLOT]``, an implicit nonzero) is its one read-back; nothing else."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    code = ("import torch, json\nfrom tests.syncs_harness import count_syncs\n"
            "from ds_dragonn.compress import DragonnCompressor\n"
            "c = DragonnCompressor(0.01, kernel='triton'); g = torch.randn(1 << 14); c.compress(g, 1)\n"
            "with count_syncs() as n:\n    c.compress(g, 2)\nprint(json.dumps(dict(n)))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert sum(counts.values()) <= 1 and all("mask_index" in k for k in counts), counts


def test_reporter_times_the_reductions_it_logs():
    """With ``log_interval`` 3 the reporter asks for phase timing before the 3rd, 6th, ... compressed
    reduction only; the telemetry's phase means count timed reductions alone."""
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.engine.reporting import Reporter
    from ds_dragonn.pipeline import ReduceStats, timing_requested
    from tests.fakes import fake_engine
    cfg = DragonnConfig(enabled=True, log_interval=3)
    rep = Reporter(fake_engine(monitor=None, global_samples=0, train_batch_size=lambda: 8), cfg, None)
    asked = []
    try:
        for i in range(7):
            asked.append(timing_requested())
            timed = asked[-1]
            rep.compressed(ReduceStats(numel=10, k=1, kept=1, capacity=2, bytes_sent=8, dense_bytes=40,
                                       compress_ms=3.0 if timed else 0.0, select_ms=2.0 if timed else 0.0,
                                       timed=timed), i)
    finally:
        pipeline.request_timing(False)
    assert asked == [False, False, True, False, False, True, False]
    t = rep.telemetry
    assert t.compressed_reductions == 7 and t.timed_reductions == 2
    assert t.phase_means()["select_ms_mean"] == 2.0 and t.compress_ms_mean == 3.0
