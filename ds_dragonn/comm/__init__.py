"""Exchange transports: the collective primitives over deepspeed.comm or mpi4py."""
from .base import CommBackend, CommError


def build_backend(cfg, group=None, comm=None) -> CommBackend:
    """The transport named by ``cfg.comm_backend`` for the process ``group`` (``comm``: the MPI communicator
    that stands for it under ``mpi``; default ``MPI_COMM_WORLD``)."""
    name = cfg.comm_backend.value if hasattr(cfg.comm_backend, "value") else str(cfg.comm_backend)
    if name == "torch":
        from .torch_backend import TorchCommBackend
        return TorchCommBackend(group)
    if name == "mpi":
        from .mpi_backend import MPICommBackend
        return MPICommBackend(cuda_aware=cfg.cuda_aware, comm=comm, group=group, timeout_s=cfg.comm_timeout_s)
    raise ValueError(f"unknown comm_backend {name!r}; choose 'torch' or 'mpi'")


__all__ = ["CommBackend", "CommError", "build_backend"]
