"""Map an MPI launcher's environment to the variables ``torch.distributed`` reads, before DeepSpeed starts.

Under ``mpirun``/``mpiexec`` a process has no ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``,
so DeepSpeed's MPI discovery would set ``MASTER_ADDR`` from ``hostname -I`` (the external interface).
:func:`setup_mpi_env` presets them from the launcher's own variables (Hydra's ``PMI_*``, Open MPI's
``OMPI_COMM_WORLD_*``; docs/mpi.md) so a single-node run stays on loopback. Variables already set are kept, but a
contradicting ``RANK``/``WORLD_SIZE`` is an error. Across several nodes without ``MASTER_ADDR`` the rendezvous is
left to DeepSpeed's discovery. Outside MPI nothing is touched.
"""
from __future__ import annotations

import os
from typing import Mapping, MutableMapping, NamedTuple, Optional

#: torch.distributed's default rendezvous port (``deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT``).
DEFAULT_MASTER_PORT = 29500
LOOPBACK = "127.0.0.1"

# (launcher name, rank, size, local rank, local size) variable names
_LAUNCHERS = (
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
)


class MPIEnvError(RuntimeError):
    """The MPI launcher's variables are inconsistent with the distributed variables already set."""


class MPIEnv(NamedTuple):
    """What an MPI launcher says about this process, and the rendezvous it was given.

    Attributes:
        launcher: ``"mpich"`` (also Intel MPI / any Hydra launcher) or ``"openmpi"``.
        rank, world_size: this process's rank in ``MPI_COMM_WORLD`` and its size.
        local_rank: rank among the processes on this node (0 if the launcher does not say).
        local_size: processes on this node (None if the launcher does not say).
        master_addr, master_port: the ``MASTER_ADDR``/``MASTER_PORT`` now in the environment.
    """
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_size: Optional[int]
    master_addr: str
    master_port: int


def detect_mpi_launcher(environ: Optional[Mapping[str, str]] = None) -> Optional[MPIEnv]:
    """Read the MPI launcher's variables; None when the process was not started by a known MPI launcher.

    ``master_addr``/``master_port`` of the result are those already in ``environ`` (empty / 0 if unset).
    """
    env = os.environ if environ is None else environ
    for name, v_rank, v_size, v_lrank, v_lsize in _LAUNCHERS:
        if v_rank in env and v_size in env:
            lsize = env.get(v_lsize)
            return MPIEnv(launcher=name, rank=int(env[v_rank]), world_size=int(env[v_size]),
                          local_rank=int(env.get(v_lrank, 0)), local_size=int(lsize) if lsize else None,
                          master_addr=env.get("MASTER_ADDR", ""), master_port=int(env.get("MASTER_PORT", 0)))
    return None


def setup_mpi_env(master_port: int = DEFAULT_MASTER_PORT,
                  environ: Optional[MutableMapping[str, str]] = None) -> Optional[MPIEnv]:
    """Preset RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from the MPI launcher. Call it before
    ``deepspeed.init_distributed()``.

    Args:
        master_port: used when ``MASTER_PORT`` is unset (every rank must use the same one).
        environ: the environment to update (default ``os.environ``).
    Returns:
        The launcher's view (:class:`MPIEnv`) with the final ``MASTER_ADDR``/``MASTER_PORT`` (``""``/0 when
        left to DeepSpeed's discovery: several nodes and no ``MASTER_ADDR``), or None outside MPI (then
        nothing is changed).
    Raises:
        MPIEnvError: ``RANK`` or ``WORLD_SIZE`` is already set to a value that contradicts the launcher's.
    """
    env = os.environ if environ is None else environ
    info = detect_mpi_launcher(env)
    if info is None:
        return None
    for var, want in (("RANK", info.rank), ("WORLD_SIZE", info.world_size)):
        have = env.get(var)
        if have is not None and int(have) != want:
            raise MPIEnvError(f"[rank {info.rank}] {var}={have} is set, but the {info.launcher} launcher says "
                              f"{want}; unset {var} or launch without mixing launchers")
    env.setdefault("RANK", str(info.rank))
    env.setdefault("WORLD_SIZE", str(info.world_size))
    env.setdefault("LOCAL_RANK", str(info.local_rank))
    if "MASTER_ADDR" not in env:
        if info.local_size != info.world_size:  # several nodes (or unknown): DeepSpeed's discovery decides
            return info._replace(master_addr="", master_port=0)
        env["MASTER_ADDR"] = LOOPBACK
    env.setdefault("MASTER_PORT", str(master_port))
    return info._replace(master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]))


__all__ = ["MPIEnv", "MPIEnvError", "detect_mpi_launcher", "setup_mpi_env", "DEFAULT_MASTER_PORT", "LOOPBACK"]
