"""Run a Python script inside every rank with a per-rank progress log (``rankio.py``), so the harness can
say which rank failed or hung. After the script returns, each rank records the distributed environment
it ended with (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

Usage: python tests/mpi/run_logged.py OUT_DIR SCRIPT [ARGS ...]
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rankio import RankLog, run_checks  # noqa: E402

out_dir, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
log = RankLog(out_dir)


def run_script():
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise RuntimeError(f"{script} exited with {stop.code}") from stop
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "MPI_LOCALRANKID")
    return {k: os.environ.get(k) for k in keys}


def _abort(code):
    from mpi4py import MPI  # the job is an MPI job: tear every rank down at once
    MPI.COMM_WORLD.Abort(code)


run_checks(log, {os.path.basename(script): run_script}, [os.path.basename(script)], _abort)
