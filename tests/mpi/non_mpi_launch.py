"""Run by ``tests.multiproc.run_ranks`` (plain processes, gloo, no mpiexec): a job that was not started by
an MPI launcher but asks for ``"comm_backend": "mpi"`` must fail with MPIWorldMismatchError on every rank."""
from pathlib import Path


def world_mismatch(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    from ds_dragonn.comm import build_backend
    from ds_dragonn.comm.mpi_backend import MPIWorldMismatchError
    from ds_dragonn.config import DragonnConfig

    dist.init_process_group("gloo")
    try:
        build_backend(DragonnConfig(enabled=True, comm_backend="mpi"))
    except MPIWorldMismatchError as err:
        Path(out_dir, f"rank{rank}.err").write_text(str(err))
    else:
        raise AssertionError(f"rank {rank}: MPICommBackend accepted an MPI world that is not the job")
    finally:
        dist.destroy_process_group()
