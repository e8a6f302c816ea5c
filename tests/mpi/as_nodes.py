"""Run ``tests/mpi/run_logged.py`` as if ``mpiexec`` had placed the ranks on nodes of ``L`` ranks each: set the
Hydra launcher's local variables (``MPI_LOCALNRANKS``, ``MPI_LOCALRANKID``) to what it exports on several hosts,
and keep the rendezvous on loopback (on several hosts ``setup_mpi_env`` would leave it to DeepSpeed's
discovery, which picks the external interface).

Usage: mpiexec -n N python tests/mpi/as_nodes.py L OUT_DIR SCRIPT [ARGS ...]   (MASTER_PORT from the harness)
"""
import os
import runpy
import sys

per_node = int(sys.argv[1])
rank = int(os.environ["PMI_RANK"])
os.environ.update(MPI_LOCALNRANKS=str(per_node), MPI_LOCALRANKID=str(rank % per_node), MASTER_ADDR="127.0.0.1")
sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_logged.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
