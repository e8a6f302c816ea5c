"""A rank that dies (or hangs) mid-training must make the other ranks fail with an error, never hang.

3 ranks train through ``ds_dragonn.initialize`` (ZeRO stage 0, DRAGONN density 0.01, policy "always",
min_compress_numel 1: every reduction is a compressed exchange); after 3 steps rank 1 stops before its next
backward (``tests/fault_cases.py``). Checked for each survivor: it got past the compressed steps before the
fault, then exited on its own with a non-zero status (not killed by this harness's timeout) and its log holds
an error (Python traceback or an abort message), and it never completed the run.

* gloo: rank 1 calls ``os._exit(3)``, or raises; or rank 1 hangs (alive) with ``"comm_timeout_s": 10`` in
  the "dragonn" block, which ds_dragonn sets on the data-parallel group the gradients are reduced on.
* MPI (``"comm_backend": "mpi"``, under ``mpiexec -n 3``): rank 1 calls ``os._exit(3)``; mpiexec must
  return non-zero within the harness timeout (skipped when mpiexec/mpi4py are missing).

The harness timeouts are generous (a hang shows up as a failure, not as a slow pass); no test asserts on
timing otherwise.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fault_cases import BAD_RANK, HANG_TIMEOUT_S, STEPS_BEFORE_FAULT
from tests.multiproc import PORT_ATTEMPTS, REPO, free_port, port_was_taken

WORLD = 3
HARNESS_TIMEOUT = 120  # s; a run takes ~10-20 s on 2 cores
SURVIVORS = [r for r in range(WORLD) if r != BAD_RANK]
#: what a rank that stopped on an error leaves in its log: a Python traceback, or C++'s abort message
ERROR_PATTERN = re.compile(r"Traceback \(most recent call last\)|terminate called|Aborted|Error", re.IGNORECASE)


@dataclass
class RankOutcome:
    returncode: int
    killed_at_timeout: bool  # still running when the harness gave up (then killed: returncode -9)
    log: str


def launch(target: str, world: int, out_dir: Path, timeout: float = HARNESS_TIMEOUT,
           env: dict | None = None, ignore_rank: int | None = None) -> list:
    """Like ``tests.multiproc.run_ranks`` but returns every rank's outcome instead of raising.

    Waits until every rank except ``ignore_rank`` (a rank that hangs on purpose) has exited, or ``timeout``
    seconds; whatever still runs then is killed and flagged ``killed_at_timeout``. A launch that failed
    only because the rendezvous port was taken is retried on a fresh port.
    """
    out_dir = Path(out_dir)
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        outcomes = _launch_once(target, world, out_dir, timeout, env, ignore_rank, port)
        if not any(o.returncode != 0 and port_was_taken(o.log, port) for o in outcomes):
            return outcomes
    return outcomes


def _launch_once(target, world, out_dir, timeout, env, ignore_rank, port) -> list:
    module, fn = target.split(":")
    procs = []
    for rank in range(world):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                 PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {}))
        log = open(out_dir / f"rank{rank}.log", "w")
        code = f"import {module} as m; m.{fn}({rank}, {world}, {str(out_dir)!r})"
        procs.append((subprocess.Popen([sys.executable, "-u", "-c", code], env=e, cwd=REPO, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    watched = [p for r, (p, _) in enumerate(procs) if r != ignore_rank]
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in watched) and time.monotonic() < deadline:
        time.sleep(0.1)
    outcomes = []
    for rank, (p, log) in enumerate(procs):
        still_running = p.poll() is None
        if still_running:
            p.kill()
        p.wait()
        log.close()
        outcomes.append(RankOutcome(p.returncode, still_running and rank != ignore_rank,
                                    (out_dir / f"rank{rank}.log").read_text(errors="replace")))
    return outcomes


def _report(outcomes: list) -> str:
    return "\n".join(f"--- rank {r}: exit {o.returncode}{' (KILLED: hung past the harness timeout)' if o.killed_at_timeout else ''}"
                     f"\n{o.log[-2500:]}" for r, o in enumerate(outcomes))


def assert_survivors_failed(outcomes: list) -> None:
    report = _report(outcomes)
    for r in SURVIVORS:
        o = outcomes[r]
        assert not o.killed_at_timeout, f"rank {r} hung after rank {BAD_RANK} failed\n{report}"
        # they got through the compressed steps before the fault (the fault hit a compressed exchange)
        assert f"STEP {STEPS_BEFORE_FAULT} ok compressed={STEPS_BEFORE_FAULT}" in o.log, report
        assert "FINISHED" not in o.log, f"rank {r} completed the run without rank {BAD_RANK}\n{report}"
        assert o.returncode != 0, f"rank {r} exited 0 after rank {BAD_RANK} failed\n{report}"
        assert ERROR_PATTERN.search(o.log.split(f"STEP {STEPS_BEFORE_FAULT} ok")[-1]), \
            f"rank {r} exited {o.returncode} without an error message\n{report}"
        # the first collective after the fault is ds_dragonn's compressed exchange: its transport names the rank
        # and the collective that failed (ds_dragonn.comm.base.CommError)
        assert f"CommError: [rank {r}] torch " in o.log, f"rank {r}: no CommError from the exchange\n{report}"


# -- gloo -----------------------------------------------------------------------------------------------------
def test_gloo_rank_exits_others_fail(tmp_path):
    outcomes = launch("tests.fault_cases:rank_exits", WORLD, tmp_path)
    assert outcomes[BAD_RANK].returncode == 3 and "FAULT exit" in outcomes[BAD_RANK].log, _report(outcomes)
    assert_survivors_failed(outcomes)


def test_gloo_rank_raises_others_fail(tmp_path):
    outcomes = launch("tests.fault_cases:rank_raises", WORLD, tmp_path)
    bad = outcomes[BAD_RANK]
    assert bad.returncode == 1 and "deliberate failure of the faulty rank" in bad.log, _report(outcomes)
    assert_survivors_failed(outcomes)


HANG_HARNESS_TIMEOUT = 90  # s: start-up (~10-15 s) + HANG_TIMEOUT_S, with a wide margin


def _assert_hung_rank_timed_out_the_others(outcomes: list) -> None:
    assert "FAULT hang" in outcomes[BAD_RANK].log, _report(outcomes)
    assert_survivors_failed(outcomes)
    for r in SURVIVORS:  # gloo's own message: the survivors stopped on the collective timeout
        assert re.search(r"timed out", outcomes[r].log, re.IGNORECASE), _report(outcomes)


def test_gloo_hung_rank_fails_others_at_the_configured_timeout(tmp_path):
    """Rank 1 stays alive but never enters the exchange; ``"comm_timeout_s": 10`` reaches the data-parallel
    group every gradient reduction runs on, so gloo ends the survivors' compressed exchange with an error
    (without it torch's 30 min default would apply there, whatever the world group's timeout)."""
    outcomes = launch("tests.fault_cases:rank_hangs_config_timeout", WORLD, tmp_path, ignore_rank=BAD_RANK,
                      timeout=HANG_HARNESS_TIMEOUT)
    for r in SURVIVORS:
        assert f"TIMEOUTS world=0:00:{HANG_TIMEOUT_S:02d} data_parallel=0:00:{HANG_TIMEOUT_S:02d}" in outcomes[r].log, \
            _report(outcomes)
    _assert_hung_rank_timed_out_the_others(outcomes)


# -- MPI ------------------------------------------------------------------------------------------------------
def _mpi_available() -> str | None:
    """None when an MPI job can be started, else why not."""
    try:
        import mpi4py  # noqa: F401
    except ImportError as err:
        return f"mpi4py is not installed ({err})"
    from tests.mpi.harness import mpiexec_path
    try:
        mpiexec_path()
    except RuntimeError as err:
        return str(err)
    return None


def _run_mpi_fault(tmp_path, mode: str):
    why = _mpi_available()
    if why:
        pytest.skip(why)
    from tests.mpi.harness import run_mpiexec
    before = set(Path("/dev/shm").glob("mpich_shm_*")) if Path("/dev/shm").is_dir() else set()
    try:
        run = run_mpiexec(["tests/mpi/fault_rank.py", str(tmp_path), mode, str(BAD_RANK)], WORLD, tmp_path,
                          timeout=HARNESS_TIMEOUT)
    finally:  # MPICH's shared-memory segment of a job torn down by a dead rank is never unlinked (3 MB a run)
        if Path("/dev/shm").is_dir():
            for leftover in set(Path("/dev/shm").glob("mpich_shm_*")) - before:
                leftover.unlink(missing_ok=True)
    report = f"mpiexec exit {run.returncode}, timed out: {run.timed_out}\n{run.output[-5000:]}"
    assert not run.timed_out, f"the MPI job hung after rank {BAD_RANK} failed ({mode})\n{report}"
    assert run.returncode != 0, report
    # the fault hit the compressed MPI exchange: every rank had finished the steps before it, none finished
    for r in range(WORLD):
        assert f"step{STEPS_BEFORE_FAULT}" in run.ranks[r].results, f"rank {r}\n{report}"
        assert not run.ranks[r].done, f"rank {r} completed the run without rank {BAD_RANK}\n{report}"
    assert f"FAULT {mode}" in run.output, report
    return run, report


def test_mpi_rank_exits_mpiexec_fails(tmp_path):
    _run_mpi_fault(tmp_path, "exit")
    # (no check on the launcher's message: MPICH's hydra tears the job down on the first bad exit and returns
    # either that rank's code (3) quietly or 9 with "BAD TERMINATION ... Killed (signal 9)", by a race)


def test_mpi_hung_rank_fails_others_at_the_configured_timeout(tmp_path):
    """Rank 1 stays alive but never enters the exchange; with ``"comm_timeout_s": 10`` the survivors' mpi4py
    collectives (polled, non-blocking) raise CommError naming their rank, and mpiexec ends the job."""
    run, report = _run_mpi_fault(tmp_path, "hang")
    survivors = [r for r in range(WORLD) if r != BAD_RANK]
    assert any(f"CommError: [rank {r}] mpi " in run.output and "timed out after 10 s" in run.output
               for r in survivors), report
