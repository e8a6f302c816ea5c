"""Per-rank progress files for scripts run under ``mpiexec`` (imported inside each rank; stdlib only).

Each rank appends JSON lines to ``<out_dir>/rank<r>.jsonl``: ``start``, one ``stage`` per check it
enters, one ``result`` per check it finishes, ``done`` at a clean exit. The pytest side
(``tests/mpi/harness.py``) reads them to say which rank failed, in which check, and which rank hung.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional

_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")


def launcher_rank() -> int:
    """This process's rank as the MPI launcher set it (readable before MPI is initialised)."""
    for var in _RANK_VARS:
        if var in os.environ:
            return int(os.environ[var])
    raise RuntimeError(f"not started by mpiexec: none of {_RANK_VARS} is set")


class RankLog:
    """Append-only progress log of one rank."""

    def __init__(self, out_dir: str, rank: Optional[int] = None):
        self.rank = launcher_rank() if rank is None else rank
        self.path = Path(out_dir) / f"rank{self.rank}.jsonl"
        self._write(event="start", pid=os.getpid())

    def _write(self, **record) -> None:
        record["t"] = time.time()
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def stage(self, name: str) -> None:
        self._write(event="stage", name=name)

    def result(self, name: str, ok: bool, detail: str = "", data=None) -> None:
        self._write(event="result", name=name, ok=ok, detail=detail, data=data)

    def done(self) -> None:
        self._write(event="done")


def run_checks(log: RankLog, checks: Dict[str, Callable[[], object]], selected: Iterable[str],
               abort: Callable[[int], None]) -> None:
    """Run ``checks[name]()`` for each selected name, logging stage and result.

    A check returns optional JSON data (stored with its result) or raises. The first exception is
    logged with its traceback and ``abort(1)`` ends the whole job at once (MPI_Abort), so other ranks
    never wait in a collective the failed rank will not enter.
    """
    for name in selected:
        log.stage(name)
        try:
            data = checks[name]()
        except BaseException:  # noqa: BLE001 - reported, then the job is aborted
            text = traceback.format_exc()
            log.result(name, False, text)
            print(f"[rank {log.rank}] check {name} FAILED:\n{text}", file=sys.stderr, flush=True)
            abort(1)
            raise
        log.result(name, True, data=data)
    log.done()
