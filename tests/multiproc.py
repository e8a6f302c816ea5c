"""Run a function on N local ranks (one subprocess each, gloo over loopback) with a hard timeout.

``run_ranks("tests.pipeline_cases:exchange_cases", world_size=2, out_dir=tmp)`` starts N interpreters that
call that function as ``fn(rank, world_size, out_dir)`` after setting RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR=127.0.0.1/MASTER_PORT. A rank that fails fails the call with its output; a rank that
hangs is killed at the timeout and reported.

The rendezvous port comes from :func:`free_port`, which only knows the port was free a moment ago:
another process can bind it before rank 0's TCPStore does (EADDRINUSE). That case, and only that
case, is retried with a fresh port (:data:`PORT_ATTEMPTS` tries in all).

Every rank runs with Python's faulthandler on, so a rank killed by a signal (SIGABRT, SIGSEGV) leaves the
Python stack of every thread in its log. ``DS_DRAGONN_RANK_DEBUG`` (opt-in) catches native crashes too:

- ``core``: core dumps on (``RLIMIT_CORE`` unlimited), each rank in its own working directory
  ``<out_dir>/rank<r>.cwd`` (``kernel.core_pattern`` is usually a relative ``core``); a rank that dies on a
  signal gets ``gdb -batch -ex "thread apply all bt"`` run on its core, appended to its log.
- ``gdb``: every rank runs under ``gdb -batch``, which prints every thread's backtrace when the rank stops
  on a signal (slower start; it changes timing more than ``core`` does).

A rank that died on a signal fails the call in every mode: the debug modes only keep the evidence.

``ranks_fixture("tests.zero_cases:zero_runs", "zero")`` makes the usual module fixture of a test file: the
function run once on its ranks, every rank's saved record its value (by world size, where it takes several).
"""
from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PORT_ATTEMPTS = 3
#: opt-in native crash capture (see the module docstring): "", "core" or "gdb"
DEBUG = os.environ.get("DS_DRAGONN_RANK_DEBUG", "").strip().lower()
if DEBUG not in ("", "core", "gdb"):
    raise ValueError(f"DS_DRAGONN_RANK_DEBUG={DEBUG!r}: expected 'core' or 'gdb' (or unset)")
GDB_BT = ["-ex", "set pagination off", "-ex", "thread apply all bt"]


#: every port :func:`free_port` handed out in this process (tests/conftest.py removes DeepSpeed's
#: /dev/shm files of these ports, and only of these, at the end of the session)
USED_PORTS: set = set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    USED_PORTS.add(port)
    return port


def port_was_taken(output: str, port: int) -> bool:
    """True when the output says ``port`` was already bound (torch's TCPStore: "... port: N, ...
    code: -98, name: EADDRINUSE, message: address already in use")."""
    text = output.lower()
    return ("eaddrinuse" in text or "address already in use" in text) and str(port) in text


def run_ranks(target: str, world_size: int, out_dir: Path, timeout: float = 240.0, env: dict | None = None) -> None:
    for attempt in range(1, PORT_ATTEMPTS + 1):
        failures, port_taken = _run_once(target, world_size, Path(out_dir), timeout, env, free_port())
        if not port_taken or attempt == PORT_ATTEMPTS:
            break
    if failures:
        raise AssertionError(f"{target} on {world_size} ranks failed:\n" + "\n".join(failures))


def _run_once(target: str, world_size: int, out_dir: Path, timeout: float, env: dict | None,
              port: int) -> tuple[list, bool]:
    """One launch on ``port``: (failure messages, whether a rank failed because the port was taken)."""
    module, fn = target.split(":")
    procs = []
    for rank in range(world_size):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                 LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                 PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {}))
        code = f"import {module} as m; m.{fn}({rank}, {world_size}, {str(out_dir)!r})"
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(_command(code), env=e, cwd=_rank_cwd(out_dir, rank), stdout=log,
                                       stderr=subprocess.STDOUT, preexec_fn=_core_on if DEBUG == "core" else None),
                      log))

    def log_text(rank: int) -> str:
        return (out_dir / f"rank{rank}.log").read_text(errors="replace")

    deadline, port_taken, hung = time.monotonic() + timeout, False, False
    while any(p.poll() is None for p, _ in procs):
        # rank 0 failing on the port leaves the others waiting for a rendezvous that never comes: stop now
        if any(p.poll() not in (None, 0) and port_was_taken(log_text(r), port) for r, (p, _) in enumerate(procs)):
            port_taken = True
            break
        if time.monotonic() > deadline:
            hung = True
            break
        time.sleep(0.05)
    for p, log in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()
    failures = []
    for rank, (p, _) in enumerate(procs):
        rc = p.returncode
        if DEBUG == "core" and rc is not None and rc < 0 and rc != -9:
            _append_core_backtrace(out_dir, rank)
        if hung and rc == -9:
            rc = "timeout (killed: hung)"
        if rc != 0:
            tail = 20000 if isinstance(rc, int) and rc < 0 and rc != -9 else 3000  # a signal: keep the stacks
            failures.append(f"rank {rank}: exit {rc} (full log: {out_dir / f'rank{rank}.log'})\n"
                            + log_text(rank)[-tail:])
    port_taken = port_taken or any(p.returncode != 0 and port_was_taken(log_text(r), port)
                                   for r, (p, _) in enumerate(procs))
    if port_taken:
        failures.insert(0, f"(rendezvous port {port} was taken by another process)")
    return failures, port_taken


def _command(code: str) -> list:
    argv = [sys.executable, "-X", "faulthandler", "-c", code]
    if DEBUG == "gdb":
        return ["gdb", "-q", "-batch", "-return-child-result", "-ex", "set pagination off",
                "-ex", "handle SIGPIPE nostop noprint", "-ex", "run", *GDB_BT[2:], "--args", *argv]
    return argv


def _rank_cwd(out_dir: Path, rank: int) -> Path:
    if DEBUG != "core":
        return REPO
    cwd = out_dir / f"rank{rank}.cwd"
    cwd.mkdir(exist_ok=True)
    return cwd


def _core_on() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _append_core_backtrace(out_dir: Path, rank: int) -> None:
    """Append every thread's native backtrace from the rank's core file to its log (core mode)."""
    cores = sorted((out_dir / f"rank{rank}.cwd").glob("core*"))
    with open(out_dir / f"rank{rank}.log", "a") as log:
        if not cores or shutil.which("gdb") is None:
            log.write(f"\n[run_ranks] no core file or no gdb in {out_dir / f'rank{rank}.cwd'}\n")
            return
        bt = subprocess.run(["gdb", "-q", "-batch", *GDB_BT, sys.executable, str(cores[-1])],
                            capture_output=True, text=True, timeout=300)
        log.write(f"\n[run_ranks] native backtrace of every thread, from {cores[-1]}:\n{bt.stdout}{bt.stderr}")


def load_rank_files(out_dir: Path, stem: str, world_size: int) -> list:
    """Every rank's ``<out_dir>/<stem>_rank<r>.pt`` (what a rank function saved), in rank order."""
    import torch
    return [torch.load(Path(out_dir) / f"{stem}_rank{r}.pt", weights_only=False) for r in range(world_size)]


def ranks_fixture(target: str, stem: str, world: int = 2, timeout: float = 400.0, env: dict | None = None,
                  worlds: list | None = None, ids: list | None = None):
    """A module-scoped pytest fixture, named by the attribute it is assigned to: ``target`` run once on ``world``
    ranks (:func:`run_ranks`), its value every rank's ``<stem>_rank<r>.pt`` (:func:`load_rank_files`). With
    ``worlds``, parametrized over those world sizes (``ids``: the test ids), its value (world size, records)."""
    import pytest

    def launch(tmp_path_factory, size: int) -> list:
        out = tmp_path_factory.mktemp(f"{stem}{size}")
        run_ranks(target, size, out, timeout=timeout, env=env)
        return load_rank_files(out, stem, size)

    if worlds is None:
        @pytest.fixture(scope="module")
        def records(tmp_path_factory):
            return launch(tmp_path_factory, world)
        return records

    @pytest.fixture(scope="module", params=worlds, ids=ids)
    def records_by_world(tmp_path_factory, request):
        return request.param, launch(tmp_path_factory, request.param)
    return records_by_world
