"""Checks of the MPI transport, run inside every rank under ``mpiexec -n N`` (driven by tests/test_mpi.py).

Usage: python tests/mpi/backend_checks.py OUT_DIR [CHECK ...]   (no CHECK: all of them, in order)

Every rank maps the MPI launcher's variables (``ds_dragonn.comm.mpi_env``), starts torch.distributed
(gloo, loopback) and then runs the same checks in the same order. References are independent of both
transports: mpi4py's pickle-based ``comm.allgather`` of plain numpy arrays, and float64 sums.
Results go to ``OUT_DIR/rank<r>.jsonl`` (``rankio.py``); the first failure aborts the job.
"""
from __future__ import annotations

import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import CHECKS as CHECK_NAMES, IDENTITY_CASES, PARTITIONED_CASES  # noqa: E402
from rankio import RankLog, run_checks  # noqa: E402

OUT_DIR = sys.argv[1]
LOG = RankLog(OUT_DIR)

from ds_dragonn.comm.mpi_env import setup_mpi_env  # noqa: E402

ENV_INFO = setup_mpi_env()  # before torch.distributed starts: RANK/.../MASTER_ADDR=127.0.0.1 from PMI_*

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.Get_rank(), COMM.Get_size()

import deepspeed  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo", verbose=False)

from ds_dragonn.comm.base import CommError  # noqa: E402
from ds_dragonn.comm.mpi_backend import MPICommBackend, MPIWorldMismatchError  # noqa: E402
from ds_dragonn.comm.torch_backend import TorchCommBackend  # noqa: E402
from ds_dragonn.compress import DragonnCompressor  # noqa: E402
from launch.bench.baselines import RandomKCompressor, TopKCompressor  # noqa: E402
from ds_dragonn.exchange import BufferMismatchError, PartitionedExchange  # noqa: E402
from ds_dragonn.exchange.ownership import HashedOwnership  # noqa: E402
from ds_dragonn.feedback import ErrorFeedback  # noqa: E402
from ds_dragonn.pipeline import CompressedAllreduce  # noqa: E402

MPI_BACKEND = MPICommBackend()
TORCH_BACKEND = TorchCommBackend()
CPU = torch.device("cpu")

# -- identity cases: sizes (0, 1, 7 and 2^20+) x dtypes x compressors (names in cases.py) -------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COMPRESSORS = {
    "dragonn": lambda: DragonnCompressor(0.01, min_sample=64),
    "topk": lambda: TopKCompressor(0.01),
    "randomk": lambda: RandomKCompressor(0.01),
}
STEPS = 3  # residuals carry over between steps
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


class Recorder:
    """Wraps a compressor and keeps the last Selection it returned (the pairs this rank sends)."""

    def __init__(self, inner):
        self.inner, self.name, self.last = inner, inner.name, None

    def compress(self, flat, seed):
        self.last = self.inner.compress(flat, seed)
        return self.last


def rank_input(case: str, step: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic per (case, rank, step); heavy-tailed so the top entries stand out."""
    seed = int(hashlib.sha256(f"{case}/{RANK}/{step}".encode()).hexdigest()[:12], 16)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4)).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (bit-identity, not float equality: -0.0 != 0.0, NaN == NaN)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(bits(t).numpy().tobytes()).hexdigest()


def float64_reference(n: int, indices: torch.Tensor, wire_values: torch.Tensor):
    """(sum, mass): float64 dense sum of every rank's sent pairs and of their magnitudes, gathered with
    mpi4py's pickle allgather (independent of both transports and of the wire format)."""
    pairs = COMM.allgather((indices.long().numpy(), wire_values.double().numpy()))
    ref, mass = np.zeros(n), np.zeros(n)
    for idx, val in pairs:
        np.add.at(ref, idx, val)
        np.add.at(mass, idx, np.abs(val))
    return ref, mass


def identity_case(case: str):
    """MPI and torch transports give bit-identical outputs and residuals, step after step; the output
    matches the float64 sum of what the ranks sent and is the same on every rank."""
    comp_name, dtype_name, rest = case.split("-", 2)
    n = int(rest.split("-")[0][1:])
    dtype = DTYPES[dtype_name]
    make = (lambda: DragonnCompressor(0.5, min_sample=64)) if rest.endswith("dense") else COMPRESSORS[comp_name]
    pipes = {}
    for label, backend in (("mpi", MPI_BACKEND), ("torch", TORCH_BACKEND)):
        pipes[label] = CompressedAllreduce(Recorder(make()), backend, ErrorFeedback(True))
    prescale, key, stats = 1.0 / WORLD, ("bucket", case), []
    for step in range(STEPS):
        seed = 7919 * step + len(case)  # same on every rank
        outs = {}
        for label, pipe in pipes.items():
            flat = rank_input(case, step, n, dtype)
            pipe(flat, key, seed, prescale=prescale, postscale=1.0)
            outs[label] = flat
        m_out, t_out = outs["mpi"], outs["torch"]
        assert same_bits(m_out, t_out), f"step {step}: outputs differ between mpi and torch transports"
        m_res = pipes["mpi"].error_feedback.residuals[key]
        t_res = pipes["torch"].error_feedback.residuals[key]
        assert same_bits(m_res, t_res), f"step {step}: residuals differ between mpi and torch transports"
        sel = pipes["mpi"].compressor.last
        sel_t = pipes["torch"].compressor.last
        assert torch.equal(sel.indices, sel_t.indices), f"step {step}: selections differ"
        ref, mass = float64_reference(n, sel.indices, sel.values.to(dtype))
        err = np.abs(m_out.double().numpy() - ref)
        bound = WORLD * UNIT_ROUNDOFF[dtype] * mass
        worst = int(np.argmax(err - bound)) if n else 0
        assert n == 0 or (err <= bound).all(), (
            f"step {step}: element {worst} = {m_out[worst].item()!r}, float64 reference {ref[worst]!r} "
            f"(bound {bound[worst]:.3g})")
        digests = COMM.allgather(digest(m_out))
        assert len(set(digests)) == 1, f"step {step}: ranks decoded different outputs: {digests}"
        counts = COMM.allgather(sel.count)
        stats.append({"step": step, "counts": counts, "k": sel.k})
    if n > 1000:
        assert all(s["counts"][RANK] > 0 for s in stats), f"nothing was sent: {stats}"
    return stats


def partitioned_case(case: str):
    """The partitioned exchange: MPI and torch transports give bit-identical outputs, worker residuals and
    server residuals, step after step; every rank decodes the same; nothing is lost (float64 sums)."""
    comp_name, dtype_name, rest = case.split("-", 2)
    n = int(rest.split("-")[0][1:])
    dtype = DTYPES[dtype_name]
    make = (lambda: DragonnCompressor(0.5, min_sample=64)) if rest.endswith("dense") else COMPRESSORS[comp_name]
    pipes = {label: CompressedAllreduce(make(), backend, ErrorFeedback(True), PartitionedExchange(backend, make()))
             for label, backend in (("mpi", MPI_BACKEND), ("torch", TORCH_BACKEND))}
    key, raw, applied, stats = ("bucket", case), np.zeros(n), np.zeros(n), []
    for step in range(STEPS):
        seed = 7919 * step + len(case)
        outs = {}
        for label, pipe in pipes.items():
            flat = rank_input(case, step, n, dtype)
            outs[label], s = pipe.reduce(flat, key, seed, postscale=1.0 / WORLD)
        raw += np.sum(COMM.allgather(flat.double().numpy()), axis=0)
        assert same_bits(outs["mpi"], outs["torch"]), f"step {step}: outputs differ between mpi and torch"
        for store in ("error_feedback", "server"):
            get = (lambda p: p.error_feedback) if store == "error_feedback" else (lambda p: p.exchange.server)
            m, t = get(pipes["mpi"]).residuals[key], get(pipes["torch"]).residuals[key]
            assert same_bits(m, t), f"step {step}: {store} residuals differ between mpi and torch transports"
        assert len(set(COMM.allgather(digest(outs["mpi"])))) == 1, f"step {step}: ranks decoded different outputs"
        applied += outs["mpi"].double().numpy()
        stats.append({"step": step, "bytes_sent": s.bytes_sent, "imbalance": s.imbalance, "k": s.k})
    own = HashedOwnership(n, WORLD)
    held = pipes["mpi"].error_feedback.residuals[key].double().clone()
    server = pipes["mpi"].exchange.server.residuals[key].double()
    held.index_add_(0, own.to_index(RANK, torch.arange(server.numel())), server)
    total = applied * WORLD + np.sum(COMM.allgather(held.numpy()), axis=0)
    tol = 4 * STEPS * WORLD * UNIT_ROUNDOFF[dtype] * (1 + np.abs(raw).max(initial=0))
    assert np.abs(total - raw).max(initial=0) <= tol, f"lost {np.abs(total - raw).max()} (tolerance {tol})"
    return stats


# -- other checks --------------------------------------------------------------------------------------
def check_mpi_env():
    """The launcher mapping gave torch.distributed the MPI layout, on loopback."""
    import deepspeed.comm as dist
    assert ENV_INFO is not None and ENV_INFO.launcher == "mpich", ENV_INFO
    want = {"RANK": str(RANK), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": os.environ["MPI_LOCALRANKID"],
            "MASTER_ADDR": "127.0.0.1"}
    got = {k: os.environ.get(k) for k in want}
    assert got == want, f"environment {got}, expected {want}"
    assert (dist.get_rank(), dist.get_world_size()) == (RANK, WORLD), (dist.get_rank(), dist.get_world_size())
    assert (MPI_BACKEND.rank, MPI_BACKEND.world_size) == (RANK, WORLD)
    return dict(ENV_INFO._asdict())


def check_primitives():
    """Each primitive against mpi4py's pickle allgather of the same data."""
    rng = np.random.default_rng(100 + RANK)
    ints = [int(v) for v in rng.integers(-2**62, 2**62, size=3)]
    assert MPI_BACKEND.all_gather_ints(ints, CPU) == COMM.allgather(ints)
    assert MPI_BACKEND.all_gather_ints([], CPU) == [[] for _ in range(WORLD)]
    for length in (0, 1, 13, 1 << 16):
        payload = torch.from_numpy(rng.integers(0, 256, size=length, dtype=np.uint8))
        rows = MPI_BACKEND.all_gather_bytes(payload)
        assert rows.shape == (WORLD, length) and rows.dtype == torch.uint8, (rows.shape, rows.dtype)
        expect = np.stack(COMM.allgather(payload.numpy())) if length else np.zeros((WORLD, 0), np.uint8)
        assert np.array_equal(rows.numpy(), expect), f"all_gather_bytes({length}) differs from the reference"
        assert same_bits(rows, TORCH_BACKEND.all_gather_bytes(payload)), "mpi and torch all_gather_bytes differ"
    for sizes in ([0] * WORLD, [(3 * RANK + 5 * d) % 11 for d in range(WORLD)], [1 << 15] * WORLD):
        blocks = [rng.integers(0, 256, size=c, dtype=np.uint8) for c in sizes]
        recv_sizes = [row[RANK] for row in COMM.allgather(sizes)]
        got = MPI_BACKEND.all_to_all_bytes(torch.from_numpy(np.concatenate(blocks)), sizes, recv_sizes)
        expect = np.concatenate(COMM.alltoall(blocks))
        assert np.array_equal(got.numpy(), expect), f"all_to_all_bytes({sizes}) differs from the reference"
        assert same_bits(got, TORCH_BACKEND.all_to_all_bytes(torch.from_numpy(np.concatenate(blocks)), sizes,
                                                             recv_sizes)), "mpi and torch all_to_all_bytes differ"
    for dtype in (torch.int64, torch.float64, torch.float32, torch.bfloat16, torch.float16):
        x = torch.from_numpy(rng.standard_normal(1001) * 100).to(dtype)
        ref = np.sum(COMM.allgather(x.double().numpy()), axis=0)
        y = x.clone()
        MPI_BACKEND.all_reduce_sum_(y)
        assert y.dtype == dtype and y.shape == x.shape
        tol = {torch.int64: 0, torch.float64: 1e-12, torch.float32: 1e-4}.get(dtype, 2.0)
        assert np.max(np.abs(y.double().numpy() - ref), initial=0) <= tol, f"all_reduce_sum_ {dtype}"
        assert len(set(COMM.allgather(digest(y)))) == 1, f"all_reduce_sum_ {dtype}: ranks differ"
    return None


def _in_sync():
    """After an error every rank can still run a normal exchange, with equal results on both transports."""
    out = {}
    for label, backend in (("mpi", MPI_BACKEND), ("torch", TORCH_BACKEND)):
        flat = rank_input("sync", 0, 5000, torch.float32)
        CompressedAllreduce(DragonnCompressor(0.01), backend, ErrorFeedback(True))(flat, "k", 3)
        out[label] = flat
    assert same_bits(out["mpi"], out["torch"]), "transports disagree after an error"


def _expect(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as err:
        msg = str(err)
        for needle in (f"[rank {RANK}]",) + needles:
            assert needle in msg, f"{exc_type.__name__} message lacks {needle!r}: {msg}"
        return msg
    raise AssertionError(f"no {exc_type.__name__} on rank {RANK}")


def check_mismatch_partitioned():
    """The partitioned exchange's own header catches ranks exchanging different buckets, on every rank."""
    n = 3000 + (7 if RANK == WORLD - 1 else 0)
    ex = PartitionedExchange(MPI_BACKEND, DragonnCompressor(0.01))
    sel = DragonnCompressor(0.01).compress(torch.randn(n), 1)
    msg = _expect(BufferMismatchError, lambda: ex.exchange("k", sel, n, torch.float32, 1), "disagree", "3007")
    _in_sync()
    return msg


def check_mismatch_scheme():
    """Ranks configured with different exchange schemes: BufferMismatchError naming them on every rank."""
    ex = PartitionedExchange(MPI_BACKEND, DragonnCompressor(0.01)) if RANK == 0 else None
    pipe = CompressedAllreduce(DragonnCompressor(0.01), MPI_BACKEND, ErrorFeedback(True), ex)
    msg = _expect(BufferMismatchError, lambda: pipe(torch.randn(3000), "k", 1), "'dragonn.exchange'",
                  "rank 0: partitioned", f"rank {WORLD - 1}: allgather")
    _in_sync()
    return msg


def check_mismatch_numel():
    """Ranks reducing buffers of different lengths: BufferMismatchError on every rank, no hang."""
    n = 3000 + (7 if RANK == WORLD - 1 else 0)
    pipe = CompressedAllreduce(DragonnCompressor(0.01), MPI_BACKEND, ErrorFeedback(True))
    msg = _expect(BufferMismatchError, lambda: pipe(torch.randn(n), "k", 1), "disagree", "3007")
    _in_sync()
    return msg


def check_mismatch_dtype():
    """Ranks reducing different dtypes: BufferMismatchError on every rank, no hang."""
    dtype = torch.bfloat16 if RANK == 0 else torch.float32
    pipe = CompressedAllreduce(DragonnCompressor(0.01), MPI_BACKEND, ErrorFeedback(True))
    msg = _expect(BufferMismatchError, lambda: pipe(torch.randn(3000).to(dtype), "k", 1), "bfloat16", "float32")
    _in_sync()
    return msg


def check_mismatch_bytes():
    """The primitive itself refuses payloads of different lengths on every rank (never truncates/hangs)."""
    msg = _expect(CommError, lambda: MPI_BACKEND.all_gather_bytes(torch.zeros(16 + RANK, dtype=torch.uint8)),
                  "different lengths")
    _in_sync()
    return msg


def check_mpi_error():
    """An MPI failure (here: a freed communicator) surfaces as CommError naming the rank and MPI's error."""
    broken = MPICommBackend()
    broken.comm.Free()
    msg = _expect(CommError, lambda: broken.all_gather_ints([1], CPU), "mpi", "MPI error class")
    _in_sync()
    return msg


def check_world_mismatch():
    """A data-parallel group that is not the MPI world: MPIWorldMismatchError on every rank."""
    group = torch.distributed.new_group([0])
    msg = _expect(MPIWorldMismatchError, lambda: MPICommBackend(group=group), f"all {WORLD} MPI ranks")
    # the launch was right: the message blames the subgroup, not the launcher
    assert "subgroup" in msg and "mpirun -np" not in msg, msg
    _in_sync()
    return msg


def check_cuda_aware_flag_on_host():
    """On host tensors cuda_aware=True and False take the same (copy-free) path and agree bit for bit."""
    aware = MPICommBackend(cuda_aware=True)
    payload = torch.arange(64, dtype=torch.uint8) + RANK
    assert same_bits(aware.all_gather_bytes(payload), MPI_BACKEND.all_gather_bytes(payload))
    aware.free()


CHECKS = {
    "mpi_env": check_mpi_env,
    "primitives": check_primitives,
    **{f"identity/{case}": (lambda c=case: identity_case(c)) for case in IDENTITY_CASES},
    **{f"partitioned/{case}": (lambda c=case: partitioned_case(c)) for case in PARTITIONED_CASES},
    "mismatch_partitioned": check_mismatch_partitioned,
    "mismatch_scheme": check_mismatch_scheme,
    "mismatch_numel": check_mismatch_numel,
    "mismatch_dtype": check_mismatch_dtype,
    "mismatch_bytes": check_mismatch_bytes,
    "mpi_error": check_mpi_error,
    "world_mismatch": check_world_mismatch,
    "cuda_aware_flag_on_host": check_cuda_aware_flag_on_host,
}
assert list(CHECKS) == CHECK_NAMES, "cases.py and backend_checks.py list different checks"

if __name__ == "__main__":
    selected = sys.argv[2:] or list(CHECKS)
    run_checks(LOG, CHECKS, selected, COMM.Abort)
    COMM.Barrier()
    torch.distributed.destroy_process_group()
