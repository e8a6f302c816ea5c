"""One rank of an MPI job dies mid-training (driven by tests/test_faults.py under ``mpiexec -n 3``).

Usage: python tests/mpi/fault_rank.py OUT_DIR MODE BAD_RANK   (MODE: exit | raise | hang, see tests/fault_cases.py;
``hang`` runs with ``"comm_timeout_s": HANG_TIMEOUT_S``)

Every rank maps the launcher's variables, starts torch.distributed (gloo, loopback) and trains through
``ds_dragonn.initialize`` with ``"comm_backend": "mpi"`` (the compressed exchange runs over mpi4py); BAD_RANK
misbehaves before the backward of step ``STEPS_BEFORE_FAULT + 1``. Progress goes to ``OUT_DIR/rank<r>.jsonl``
(``rankio.py``): one ``step<n>`` result per completed step and ``done`` only at the end of the run. Unlike
``backend_checks.py`` nothing here calls MPI_Abort: what ends the job is mpiexec and the product, as in a
user's training script.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rankio import RankLog  # noqa: E402

out_dir, mode, bad = sys.argv[1], sys.argv[2], int(sys.argv[3])
LOG = RankLog(out_dir)

from ds_dragonn.comm.mpi_env import setup_mpi_env  # noqa: E402

setup_mpi_env()  # RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR=127.0.0.1 from PMI_* (before torch.distributed)

import deepspeed  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo", verbose=False)

from tests.fault_cases import HANG_TIMEOUT_S, train_with_fault  # noqa: E402

LOG.stage("train")
extra = {"comm_timeout_s": HANG_TIMEOUT_S} if mode == "hang" else {}
train_with_fault(LOG.rank, mode, comm_backend="mpi", bad_rank=bad,
                 on_step=lambda step: LOG.result(f"step{step}", True), **extra)
LOG.done()
