"""Start a script under ``mpiexec -n N`` from pytest, with a hard timeout and a per-rank report.

The job runs in its own session under coreutils ``timeout`` (TERM at the limit, KILL 5 s later), and
whatever is left of its process group is killed afterwards, so a hung rank never outlives the test.
Ranks log progress with ``tests/mpi/rankio.py``; :class:`MPIRun` turns those logs into messages that
name the rank that failed (with its traceback) or hung (with the check it was in).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tests.multiproc import PORT_ATTEMPTS, REPO, free_port, port_was_taken

# Variables that would make a rank skip the MPI launcher mapping or talk to another job.
_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
          "CROSS_SIZE", "PMI_RANK", "PMI_SIZE", "PMI_FD", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


def mpiexec_path() -> str:
    """The ``mpiexec`` next to this interpreter (the venv's MPICH), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: install the MPI extra (pip install -e '.[mpi]': mpi4py + mpich), "
                           "which launch/setup_env.sh does")
    return found


def rank_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for the job: no inherited rank/rendezvous variables, a fresh loopback port."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))  # as launch/setup_env.sh
    env.update(extra or {})
    return env


@dataclass
class RankState:
    started: bool = False
    stages: List[str] = field(default_factory=list)
    results: Dict[str, dict] = field(default_factory=dict)
    done: bool = False

    @property
    def last_stage(self) -> Optional[str]:
        return self.stages[-1] if self.stages else None


@dataclass
class MPIRun:
    """Outcome of one ``mpiexec`` job."""
    cmd: List[str]
    world_size: int
    timeout: float
    returncode: int
    timed_out: bool
    output: str
    wall_s: float
    ranks: Dict[int, RankState]

    def failure_report(self) -> Optional[str]:
        """None when every rank finished cleanly; otherwise who failed or hung, and why."""
        lines = []
        for r in range(self.world_size):
            st = self.ranks[r]
            failed = [(n, res) for n, res in st.results.items() if not res["ok"]]
            if failed:
                for name, res in failed:
                    lines.append(f"rank {r} FAILED in {name!r}:\n{res['detail'].rstrip()}")
            elif not st.done:
                if self.timed_out:
                    where = f"in {st.last_stage!r}" if st.last_stage else "before its first check"
                    lines.append(f"rank {r} HUNG {where} (killed after {self.timeout:.0f} s)" if st.started
                                 else f"rank {r} HUNG: never started (killed after {self.timeout:.0f} s)")
                else:
                    where = f"in {st.last_stage!r}" if st.last_stage else "before its first check"
                    lines.append(f"rank {r} did not finish: stopped {where}")
        if not lines and (self.returncode != 0 or self.timed_out):
            lines.append(f"every rank finished but mpiexec returned {self.returncode}")
        if not lines:
            return None
        head = (f"`{' '.join(self.cmd)}` "
                + (f"timed out after {self.timeout:.0f} s" if self.timed_out else f"exit code {self.returncode}"))
        return head + "\n" + "\n".join(lines) + "\n--- output (tail) ---\n" + self.output[-4000:]

    def check_result(self, name: str) -> Dict[int, dict]:
        """``{rank: result record}`` of one check; raises AssertionError naming the ranks that failed
        it, never reached it, or hung in it (with the job's report)."""
        missing = [r for r in range(self.world_size) if name not in self.ranks[r].results]
        bad = [r for r in range(self.world_size) if name in self.ranks[r].results
               and not self.ranks[r].results[name]["ok"]]
        if bad:
            raise AssertionError(f"check {name!r} on {self.world_size} ranks: failed on ranks {bad}"
                                 f"\n{self.failure_report()}")
        if missing:
            report = self.failure_report() or ""
            why = report.splitlines()[1] if report.count("\n") else "the job ended early"
            raise AssertionError(f"check {name!r} on {self.world_size} ranks: no result from ranks {missing} "
                                 f"(the job stopped before it: {why})\n{report}")
        return {r: self.ranks[r].results[name] for r in range(self.world_size)}


def run_mpiexec(script: Sequence[str], world_size: int, out_dir: Path, timeout: float = 90.0,
                env: Optional[Dict[str, str]] = None) -> MPIRun:
    """Run ``mpiexec -n world_size <script...>`` (script[0] a Python file, or a full command when it is
    not a ``.py``), in the repository root, killing it after ``timeout`` seconds.

    The job's MASTER_PORT (from :func:`free_port`) may be bound by another process before rank 0's
    TCPStore binds it: when the output says so (EADDRINUSE), the job is stopped at once and started
    again on a fresh port (``PORT_ATTEMPTS`` launches in all); any other failure is returned as is.

    Returns the :class:`MPIRun`; it does not raise on failure (call :meth:`MPIRun.failure_report`).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-u", *script] if str(script[0]).endswith(".py") else list(script)
    cmd = [mpiexec_path(), "-n", str(world_size), *argv]
    full = ["timeout", "-k", "5", str(int(timeout)), *cmd]
    t0 = time.time()
    for attempt in range(1, PORT_ATTEMPTS + 1):
        job_env = rank_env() if env is None else dict(env)  # rank_env(): a fresh port each time
        if attempt > 1:
            if env is not None:
                job_env["MASTER_PORT"] = str(free_port())
            for r in range(world_size):  # the rank logs are appended to: start them afresh
                (out_dir / f"rank{r}.jsonl").unlink(missing_ok=True)
        rc, output, port_taken = _run_job(full, job_env, timeout)
        if not port_taken:
            break
    return MPIRun(cmd=[Path(cmd[0]).name, *cmd[1:]], world_size=world_size, timeout=timeout, returncode=rc,
                  timed_out=rc in (124, 137), output=output, wall_s=time.time() - t0,
                  ranks=read_rank_logs(out_dir, world_size))


def _run_job(full: List[str], env: Dict[str, str], timeout: float):
    """One launch: (return code, output, whether it failed because MASTER_PORT was taken)."""
    port = int(env.get("MASTER_PORT", 0))  # 0: no rendezvous port to watch
    fd, log = tempfile.mkstemp(prefix="mpiexec-", suffix=".log")
    try:
        with os.fdopen(fd, "w") as out:  # the job writes here; we read through a separate descriptor
            proc = subprocess.Popen(full, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

        def output() -> str:
            return Path(log).read_text(errors="replace")

        backstop = time.monotonic() + timeout + 20  # if `timeout` itself is stuck
        port_taken = False
        while proc.poll() is None:
            if time.monotonic() > backstop:
                break
            if port and port_was_taken(output(), port):  # rank 0 could not bind; the others would wait
                port_taken = True
                break
            time.sleep(0.1)
        rc = proc.poll()
        try:  # ranks re-parented after mpiexec died stay in the job's process group
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if rc is None:
            rc = 1 if port_taken else 137
        text = output()
    finally:
        os.unlink(log)
    return rc, text, port_taken or bool(port and rc != 0 and port_was_taken(text, port))


def read_rank_logs(out_dir: Path, world_size: int) -> Dict[int, RankState]:
    states = {}
    for r in range(world_size):
        st = RankState()
        path = Path(out_dir) / f"rank{r}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the kill
                    continue
                ev = rec["event"]
                st.started |= ev == "start"
                if ev == "stage":
                    st.stages.append(rec["name"])
                elif ev == "result":
                    st.results[rec["name"]] = rec
                elif ev == "done":
                    st.done = True
        states[r] = st
    return states
