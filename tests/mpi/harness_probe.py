"""Harness self-check, run under mpiexec: every rank passes, or one rank fails or hangs on purpose.

Usage: python tests/mpi/harness_probe.py OUT_DIR MODE BAD_RANK  (MODE: ok | fail | hang)
No MPI collectives and no torch, so it starts in well under a second.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rankio import RankLog, run_checks  # noqa: E402

out_dir, mode, bad = sys.argv[1], sys.argv[2], int(sys.argv[3])
log = RankLog(out_dir)


def probe():
    if log.rank == bad and mode == "fail":
        raise RuntimeError("deliberate failure")
    if log.rank == bad and mode == "hang":
        time.sleep(3600)
    return {"rank": log.rank}


def _exit(code):  # what MPI_Abort does for an MPI job: the launcher tears the job down
    os._exit(code)


run_checks(log, {"probe": probe}, ["probe"], _exit)
if mode == "hang" and log.rank != bad:
    pass  # healthy ranks finish; the hung one keeps the job alive until the timeout
