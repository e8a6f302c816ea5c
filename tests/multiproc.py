"""Run a function on N local ranks (one subprocess each, gloo over loopback) with a hard timeout.

``run_ranks("tests.dist_cases:exchange_cases", world_size=2, out_dir=tmp)`` starts N interpreters that
call that function as ``fn(rank, world_size, out_dir)`` after setting RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR=127.0.0.1/MASTER_PORT. A rank that fails fails the call with its output; a rank that
hangs is killed at the timeout and reported.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: str, world_size: int, out_dir: Path, timeout: float = 240.0, env: dict | None = None) -> None:
    module, fn = target.split(":")
    port = free_port()
    procs = []
    for rank in range(world_size):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                 LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                 PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {}))
        code = f"import {module} as m; m.{fn}({rank}, {world_size}, {str(out_dir)!r})"
        log = open(Path(out_dir) / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-c", code], env=e, cwd=REPO, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    failures = []
    for rank, (p, log) in enumerate(procs):
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            rc = "timeout (killed: hung)"
        log.close()
        if rc != 0:
            failures.append(f"rank {rank}: exit {rc}\n" + (Path(out_dir) / f"rank{rank}.log").read_text()[-3000:])
    if failures:
        raise AssertionError(f"{target} on {world_size} ranks failed:\n" + "\n".join(failures))
