"""Collectives over MPI through mpi4py (``"comm_backend": "mpi"``).

``torch.distributed`` has no MPI backend in pip builds, so this transport calls mpi4py directly, as DeepSpeed's
former ``runtime/comm/mpi.py`` did. It implements only :class:`~ds_dragonn.comm.base.CommBackend`'s primitives;
packing and the agreement checks live in ``ds_dragonn.exchange``, so both transports move the same bytes and
return bit-identical results. CPU tensors go to MPI without a copy; device tensors are staged through host
memory, or with ``cuda_aware`` handed over after a stream sync (docs/mpi.md).

Timeout: with ``timeout_s`` every collective is started non-blocking and polled against the deadline, then
raises :class:`~ds_dragonn.comm.base.CommError`. MPI cannot cancel a started collective, so that error ends the
job, and a process in which one timed out calls ``MPI_Abort`` at exit (:func:`_abort_at_exit`) instead of
``MPI_Finalize``, which would wait for ever. The collectives run on a duplicate of ``MPI_COMM_WORLD``; every MPI
failure is a ``CommError`` whose message starts with ``[rank r]``.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence

import numpy as np
import torch

from .base import CommBackend, CommError

try:
    from mpi4py import MPI
except ImportError as _err:  # pragma: no cover - depends on the install
    MPI = None
    _IMPORT_ERROR: Optional[ImportError] = _err
else:
    _IMPORT_ERROR = None

# MPI has no reduction for these; all_reduce_sum_ sums them in float32.
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class MPIWorldMismatchError(CommError):
    """The MPI world and the data-parallel group of ``torch.distributed`` are not the same processes."""


class MPICommBackend(CommBackend):
    """mpi4py collectives over all processes of the MPI job.

    Args:
        cuda_aware: hand device buffers to MPI directly (True) or stage them through host memory (False).
        comm: the MPI communicator to duplicate (default ``MPI.COMM_WORLD``).
        group: the ``torch.distributed`` process group this transport stands in for (None = the default
            group); where initialised, its size and this rank must equal the MPI ones.
        timeout_s: seconds a collective may wait for the other ranks before :class:`CommError` (None: for ever).
    Raises:
        ImportError: mpi4py is not installed.
        MPIWorldMismatchError: MPI and ``torch.distributed`` disagree on the world size or on this process's
            rank (e.g. a non-MPI launcher: every process is its own MPI world of size 1).
    """

    name = "mpi"

    def __init__(self, cuda_aware: bool = False, comm: Optional[Any] = None, group: Optional[Any] = None,
                 timeout_s: Optional[float] = None):
        if MPI is None:
            raise ImportError("'comm_backend': 'mpi' needs mpi4py and an MPI library: "
                              "pip install 'ds_dragonn[mpi]' (mpi4py + mpich)") from _IMPORT_ERROR
        base = MPI.COMM_WORLD if comm is None else comm
        self.cuda_aware = bool(cuda_aware)
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive seconds or None, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._rank = base.Get_rank()
        self._world_size = base.Get_size()
        _check_same_world(self._rank, self._world_size, group)
        try:
            self.comm = base.Dup()
        except MPI.Exception as err:
            raise self._fail("Comm.Dup", err) from err

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    # -- primitives ---------------------------------------------------------------------------------
    def all_gather_ints(self, values: Sequence[int] | torch.Tensor, device: torch.device) -> List[List[int]]:
        """Gather ``len(values)`` int64s from every rank: ``result[r]`` is rank r's list.

        ``device`` is ignored (host memory). Every rank must pass the same number of values.
        """
        local = np.asarray(values.tolist() if torch.is_tensor(values) else list(values), dtype=np.int64)
        out = np.empty((self._world_size, local.size), dtype=np.int64)
        self._call("Allgather(ints)", self.comm.Iallgather, local, out)
        return out.tolist()

    def all_gather_bytes(self, payload: torch.Tensor) -> torch.Tensor:
        """Gather a (L,) uint8 tensor from every rank.

        Args:
            payload: (L,) uint8, any device; L must be equal on every rank.
        Returns:
            (world_size, L) uint8 on ``payload``'s device; row r is rank r's payload.
        Raises:
            TypeError: ``payload`` is not a 1-D uint8 tensor.
            CommError: on every rank, when ranks pass different L (checked with one int64 allgather
                first, so a mismatch never truncates or hangs), or when MPI fails.
        """
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise TypeError(f"[rank {self._rank}] all_gather_bytes takes a 1-D uint8 tensor, "
                            f"got {payload.dtype} of shape {tuple(payload.shape)}")
        lengths = [row[0] for row in self.all_gather_ints([payload.numel()], payload.device)]
        if len(set(lengths)) > 1:
            per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
            raise CommError(f"[rank {self._rank}] mpi all_gather_bytes: ranks pass payloads of different "
                            f"lengths ({per_rank} bytes)")
        send, staged = self._to_mpi(payload.contiguous())
        out = torch.empty((self._world_size, payload.numel()), dtype=torch.uint8,
                          device=send.device)
        self._call("Allgather(bytes)", self.comm.Iallgather, send, out)
        return out.to(payload.device) if staged else out

    def all_to_all_bytes(self, payload: torch.Tensor, send_sizes: Sequence[int],
                         recv_sizes: Sequence[int]) -> torch.Tensor:
        """``MPI_Alltoallv`` of bytes; see :meth:`CommBackend.all_to_all_bytes`.

        Raises:
            TypeError: ``payload`` is not a 1-D uint8 tensor.
            ValueError: the sizes do not have ``world_size`` entries or do not add up to the payload.
            CommError: MPI failed.
        """
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise TypeError(f"[rank {self._rank}] all_to_all_bytes takes a 1-D uint8 tensor, "
                            f"got {payload.dtype} of shape {tuple(payload.shape)}")
        send_sizes, recv_sizes = [int(v) for v in send_sizes], [int(v) for v in recv_sizes]
        if len(send_sizes) != self._world_size or len(recv_sizes) != self._world_size \
                or sum(send_sizes) != payload.numel():
            raise ValueError(f"[rank {self._rank}] all_to_all_bytes: {len(send_sizes)} send / {len(recv_sizes)} "
                             f"receive sizes for {self._world_size} ranks, {sum(send_sizes)} bytes declared for a "
                             f"payload of {payload.numel()}")
        send, staged = self._to_mpi(payload.contiguous())
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
        s_disp, r_disp = np.cumsum([0] + send_sizes[:-1]), np.cumsum([0] + recv_sizes[:-1])
        self._call("Alltoallv(bytes)", self.comm.Ialltoallv,
                   [send, (send_sizes, s_disp.tolist()), MPI.BYTE], [out, (recv_sizes, r_disp.tolist()), MPI.BYTE])
        return out.to(payload.device) if staged else out

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        """In-place sum over ranks of a dense tensor (any shape, contiguous; any device).

        fp16/bf16 are summed in float32 and rounded once. Sums follow MPI's reduction order (may differ from
        NCCL/gloo in the last bit).

        Raises:
            ValueError: ``tensor`` is not contiguous.
            CommError: MPI failed.
        """
        if not tensor.is_contiguous():
            raise ValueError(f"[rank {self._rank}] all_reduce_sum_ needs a contiguous tensor")
        work = tensor.to(_UPCAST[tensor.dtype]) if tensor.dtype in _UPCAST else tensor
        buf, staged = self._to_mpi(work)
        self._call("Allreduce(sum)", self.comm.Iallreduce, MPI.IN_PLACE, buf, MPI.SUM)
        if staged or buf is not tensor:
            tensor.copy_(buf)

    # -- helpers ------------------------------------------------------------------------------------
    def _to_mpi(self, t: torch.Tensor):
        """(buffer MPI may read/write, whether it is a host copy of a device tensor)."""
        if t.device.type == "cpu":
            return t, False
        if self.cuda_aware:
            if t.device.type == "cuda":
                torch.cuda.current_stream(t.device).synchronize()
            return t, False
        return t.to("cpu"), True  # synchronous copy: complete when MPI reads it

    def _call(self, op: str, start, *args) -> None:
        """Start the non-blocking collective ``start(*args)`` and wait for it (up to :attr:`timeout_s`).

        Raises:
            CommError: MPI failed, or the collective did not complete within ``timeout_s`` seconds.
        """
        try:
            request = start(*args)
            if self.timeout_s is None:
                request.Wait()
                return
            deadline, polls = time.monotonic() + self.timeout_s, 0
            while not request.Test():
                polls += 1
                if polls > 100:  # past the first microseconds: yield the core to the process we wait for
                    if time.monotonic() > deadline:
                        _abort_at_exit(self.comm)
                        raise CommError(
                            f"[rank {self._rank}] mpi {op} timed out after {self.timeout_s:g} s ('comm_timeout_s'): "
                            f"at least one of the {self._world_size} ranks never entered it (it stopped or hangs). "
                            f"MPI cannot cancel a started collective: this run must end")
                    time.sleep(min(1e-3, 1e-6 * polls))
        except MPI.Exception as err:
            raise self._fail(op, MPIErrorText(err)) from err

    def free(self) -> None:
        """Release the duplicated communicator (collective; optional, MPI frees it at finalisation)."""
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


_ABORT_REGISTERED = False


def _abort_at_exit(comm: Any) -> None:
    """At interpreter exit, ``MPI_Abort`` instead of mpi4py's ``MPI_Finalize``, which would wait for ever for the
    collective that timed out (``atexit`` handlers run before mpi4py's ``Py_AtExit`` finalisation)."""
    global _ABORT_REGISTERED
    if _ABORT_REGISTERED:
        return
    _ABORT_REGISTERED = True
    import atexit
    import sys

    def abort() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        comm.Abort(1)
    atexit.register(abort)


class MPIErrorText(Exception):
    """An ``MPI.Exception`` rendered with its error class and MPI's own message."""

    def __init__(self, err: Any):
        try:
            text = f"{err.Get_error_string().strip()} (MPI error class {err.Get_error_class()})"
        except Exception:  # noqa: BLE001 - best effort; the original error is chained anyway
            text = str(err)
        super().__init__(text)


def _check_same_world(mpi_rank: int, mpi_size: int, group: Optional[Any]) -> None:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    t_size = torch.distributed.get_world_size(group=group)
    t_rank = torch.distributed.get_rank(group=group)
    if (t_size, t_rank) == (mpi_size, mpi_rank):
        return
    member = f"this process is its rank {t_rank}" if t_rank >= 0 else "this process is not in it"
    if t_size != mpi_size and torch.distributed.get_world_size() == mpi_size:
        # the launch is right: the data-parallel group is a subgroup (model, pipeline or sequence parallelism)
        hint = ("the data-parallel group is a subgroup of the job's world, and the mpi backend exchanges over "
                "MPI's whole world")
    elif t_size != mpi_size:
        hint = (f"launch every rank with MPI ('mpirun -np {mpi_size if t_size < 1 else t_size} python "
                f"launch/train.py ...' or 'deepspeed --launcher mpich|openmpi --hostfile ...')")
    else:
        hint = "launch with mpirun/mpiexec so that RANK is the MPI rank"
    raise MPIWorldMismatchError(
        f"[rank {torch.distributed.get_rank()}] 'comm_backend': 'mpi' exchanges over all {mpi_size} MPI ranks (this process is "
        f"MPI rank {mpi_rank}), but the torch.distributed data-parallel group has {max(t_size, 0)} ranks "
        f"({member}); {hint}, or use 'comm_backend': 'torch'")


def shared_memory_view() -> tuple:
    """(ranks on this node, this rank's index among them) from MPI's shared-memory split
    (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``): the node layout where the launcher exported none."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=MPI.COMM_WORLD.Get_rank())
    try:
        return node.Get_size(), node.Get_rank()
    finally:
        node.Free()


def split_comm(color: int, key: int) -> Any:
    """``MPI_COMM_WORLD`` split by ``color`` (ordered by ``key``): the node-aware exchange's node and cross-node
    communicators. Collective over every MPI rank."""
    return MPI.COMM_WORLD.Split(color, key)


__all__ = ["MPICommBackend", "MPIWorldMismatchError", "shared_memory_view", "split_comm"]
