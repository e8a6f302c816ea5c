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

Starting ranks costs more than most rank functions (each rank imports torch and DeepSpeed: ~5-10 s for 2 ranks
on 2 cores, more for 3 or 4), so ``ranks_fixture(..., pool="name")`` lets fixtures share one launch: the first
one used starts, for its world size, every fixture of that pool that a collected test uses (in any test file;
none whose tests are deselected), one after the other in the same ranks (:func:`pooled`), each in its own
folder with its own timeout. Between them what a fresh process has is put back (:func:`_process_state`:
``os.environ``, the module globals of ``ds_dragonn`` and ``tests``, ``deepspeed.initialize``,
``torch.nn.functional.linear``, which a ZeRO-3 engine replaces for good, torch's settings, the random states).
A rank function that failed in the pool, or did not run because an earlier one failed, is run again alone: its
failure is reported as its own and the others' results are kept (a rerun that passes fails the fixture too:
the pool must never change a result). The suite's pools: "gloo" (the pipeline and exchange cases and the
shorter engine runs) and "zero" (the longer ZeRO engine runs), two so that no launch takes more than a few
minutes of one test's time limit. Rank functions whose results are compared with another launch's (a
checkpoint saved here and loaded by fresh processes, tests/test_checkpoint.py) stay out of pools.
"""
from __future__ import annotations

import importlib
import json
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


def remove_shm_files(port: int) -> None:
    """Remove DeepSpeed's CPU allreduce files of ``port`` (``deepspeed_allreduce_buffer_*_<addr>_<port>_<rank>`` in
    /dev/shm, 69 MB per rank, never unlinked by DeepSpeed) once the launch that used the port has ended: a suite
    killed later (out of memory, a timeout) leaves at most its running launch's files."""
    shm = Path("/dev/shm")
    for path in shm.glob(f"deepspeed_allreduce_buffer_*_{port}_*") if shm.is_dir() else ():
        parts = path.name.split("_")
        if len(parts) >= 3 and parts[-2] == str(port):
            try:
                path.unlink()
            except OSError:  # removed meanwhile
                pass


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


def run_ranks(target: str, world_size: int, out_dir: Path, timeout: float = 240.0, env: dict | None = None,
              stages: list | None = None) -> None:
    """``stages``: [(marker file, timeout), ...] for a launch that runs several things in turn (:func:`pooled`):
    each stage has its own ``timeout``, from the moment the previous stage's marker file appeared."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        failures, port_taken = _run_once(target, world_size, Path(out_dir), timeout, env, free_port(), stages)
        if not port_taken or attempt == PORT_ATTEMPTS:
            break
    if failures:
        raise AssertionError(f"{target} on {world_size} ranks failed:\n" + "\n".join(failures))


def _run_once(target: str, world_size: int, out_dir: Path, timeout: float, env: dict | None,
              port: int, stages: list | None = None) -> tuple[list, bool]:
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

    stages = list(stages or [])
    deadline, port_taken, hung = time.monotonic() + (stages[0][1] if stages else timeout), False, False
    try:
        while any(p.poll() is None for p, _ in procs):
            # rank 0 failing on the port leaves the others waiting for a rendezvous that never comes: stop now
            if any(p.poll() not in (None, 0) and port_was_taken(log_text(r), port)
                   for r, (p, _) in enumerate(procs)):
                port_taken = True
                break
            while stages and Path(stages[0][0]).exists():  # a stage done: the next one's own timeout
                stages.pop(0)
                deadline = time.monotonic() + (stages[0][1] if stages else timeout)
            if time.monotonic() > deadline:
                hung = True
                break
            time.sleep(0.05)
    finally:  # also when pytest interrupts the wait (Ctrl-C, its own timeout): no rank outlives the launch
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
        remove_shm_files(port)  # the ranks are gone: their DeepSpeed /dev/shm files go with the launch
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


class RankRecords(list):
    """Every rank's record, in rank order; ``out_dir``: the folder the rank function wrote them (and anything
    else) to."""

    def __init__(self, records, out_dir: Path):
        super().__init__(records)
        self.out_dir = Path(out_dir)


def load_rank_files(out_dir: Path, stem: str, world_size: int) -> RankRecords:
    """Every rank's ``<out_dir>/<stem>_rank<r>.pt`` (what a rank function saved), in rank order."""
    import torch
    return RankRecords([torch.load(Path(out_dir) / f"{stem}_rank{r}.pt", weights_only=False)
                        for r in range(world_size)], out_dir)


def ranks_fixture(target: str, stem: str, world: int = 2, timeout: float = 400.0, env: dict | None = None,
                  worlds: list | None = None, ids: list | None = None, pool: str | None = None):
    """A module-scoped pytest fixture, named by the attribute it is assigned to: ``target`` run once on ``world``
    ranks (:func:`run_ranks`), its value every rank's ``<stem>_rank<r>.pt`` (:func:`load_rank_files`). With
    ``worlds``, parametrized over those world sizes (``ids``: the test ids), its value (world size, records).
    With ``pool``, launched together with the other fixtures of that pool and world size (the module docstring)."""
    import pytest

    members = {size: _Member(target, stem, size, timeout, dict(env or {}), pool)
               for size in (worlds if worlds is not None else [world])}

    def launch(tmp_path_factory, request, size: int) -> list:
        member = members[size]
        if pool is not None:
            return _pooled_records(tmp_path_factory, request, member)
        out = tmp_path_factory.mktemp(f"{stem}{size}")
        run_ranks(target, size, out, timeout=timeout, env=env)
        return load_rank_files(out, stem, size)

    if worlds is None:
        @pytest.fixture(scope="module")
        def records(tmp_path_factory, request):
            return launch(tmp_path_factory, request, world)
        fixture = records
    else:
        @pytest.fixture(scope="module", params=worlds, ids=ids)
        def records_by_world(tmp_path_factory, request):
            return request.param, launch(tmp_path_factory, request, request.param)
        fixture = records_by_world
    for m in members.values():
        m.fixture = fixture
        if pool is not None:
            _POOLS.setdefault((pool, m.world), []).append(m)
    return fixture


class _Member:
    """One rank function of a pool at one world size, and what became of it."""

    def __init__(self, target: str, stem: str, world: int, timeout: float, env: dict, pool: str | None):
        self.target, self.stem, self.world, self.timeout, self.env, self.pool = target, stem, world, timeout, env, pool
        self.fixture = None  # the pytest fixture (the module attribute) that returns its records
        self.out: Path | None = None  # its folder in the pool's launch (None: not in the launch)

    def used_by(self, item) -> bool:
        """Whether the collected test ``item`` uses this member (its fixture, at this world size)."""
        module = getattr(item, "module", None)
        for name in getattr(item, "fixturenames", ()):
            if module is not None and getattr(module, name, None) is self.fixture:
                params = getattr(getattr(item, "callspec", None), "params", {})
                return params.get(name, self.world) == self.world
        return False


#: (pool, world size) -> its members, in the order the test files registered them
_POOLS: dict = {}
#: (pool, world size) -> the failure text of its launch ("" when it passed), once launched
_POOL_LAUNCHES: dict = {}
POOL_ENV = "DS_DRAGONN_POOL"
DONE = "pool_done"


def _pooled_records(tmp_path_factory, request, member: _Member) -> list:
    key = (member.pool, member.world)
    if key not in _POOL_LAUNCHES:
        items = request.session.items
        used = [m for m in _POOLS[key] if m is member or any(m.used_by(item) for item in items)]
        out = tmp_path_factory.mktemp(f"pool_{member.pool}{member.world}")
        entries = []
        for i, m in enumerate(used):
            m.out = out / f"{i}_{m.stem}"
            entries.append([m.target, str(m.out), m.env])
        try:
            run_ranks("tests.multiproc:pooled", member.world, out, timeout=60.0,
                      env={POOL_ENV: json.dumps(entries)},
                      stages=[(m.out / DONE, m.timeout) for m in used])
            _POOL_LAUNCHES[key] = ""
        except AssertionError as err:
            _POOL_LAUNCHES[key] = str(err)
    if member.out is not None and (member.out / DONE).exists():
        return load_rank_files(member.out, member.stem, member.world)
    # failed in the pool (its folder is made when it starts), or not run there: alone, as without a pool
    out = tmp_path_factory.mktemp(f"{member.stem}{member.world}")
    run_ranks(member.target, member.world, out, timeout=member.timeout, env=member.env)
    if member.out is not None and member.out.exists():
        raise AssertionError(f"{member.target} failed in pool {member.pool!r} on {member.world} ranks but "
                             f"passed alone: the pool changed its result\n{_POOL_LAUNCHES[key]}")
    return load_rank_files(out, member.stem, member.world)


#: modules whose namespaces a rank function may rebind and a fresh process would not have rebound: DeepSpeed's
#: ZeRO-3 replaces ``torch.nn.functional.linear`` for the rest of the process ("This will persist unless manually
#: reset"), which would send later engines' Linear layers through its own autograd function
_SNAPSHOT_MODULES = ("deepspeed", "torch", "torch.nn.functional")
#: classes whose attributes DeepSpeed's ``zero.Init`` patches while it is active
_SNAPSHOT_CLASSES = ("torch.nn.Module", "torch.Tensor")


def _process_state() -> dict:
    """What a rank function may change and a fresh process starts without: every ``ds_dragonn`` and ``tests``
    module's namespace and those of :data:`_SNAPSHOT_MODULES`, copied (shallow; all of ``ds_dragonn`` imported
    first), the attributes of :data:`_SNAPSHOT_CLASSES`, ``os.environ``, torch's thread count, default dtype and
    grad mode, and the random generators' states."""
    import pkgutil
    import random

    import torch

    import ds_dragonn
    for info in pkgutil.walk_packages(ds_dragonn.__path__, "ds_dragonn."):
        importlib.import_module(info.name)
    classes = {"torch.nn.Module": torch.nn.Module, "torch.Tensor": torch.Tensor}
    return {"modules": {name: dict(vars(mod)) for name, mod in list(sys.modules.items())
                        if mod is not None and (name.split(".")[0] in ("ds_dragonn", "tests")
                                                or name in _SNAPSHOT_MODULES)},
            "classes": {name: (classes[name], dict(vars(classes[name]))) for name in _SNAPSHOT_CLASSES},
            "environ": dict(os.environ), "threads": torch.get_num_threads(), "dtype": torch.get_default_dtype(),
            "grad": torch.is_grad_enabled(), "torch_rng": torch.get_rng_state(), "random": random.getstate(),
            "numpy": _numpy_state()}


def _numpy_state():
    numpy = sys.modules.get("numpy")
    return None if numpy is None else numpy.random.get_state()


def _restore_process_state(saved: dict) -> None:
    """Put back what :func:`_process_state` saved: every global a rank function rebound (a constant, a patched
    function, a cache; names it added stay: a submodule imported since is such a name), the class attributes,
    the environment, torch's settings and the random states."""
    import random

    import torch
    for name, namespace in saved["modules"].items():
        now = vars(sys.modules[name]) if name in sys.modules else None
        if now is None:
            continue
        for k, v in namespace.items():
            if k not in now or now[k] is not v:
                now[k] = v
    for cls, attributes in saved["classes"].values():
        for k, v in attributes.items():
            if vars(cls).get(k, v) is not v or k not in vars(cls):
                setattr(cls, k, v)
    os.environ.clear()
    os.environ.update(saved["environ"])
    torch.set_num_threads(saved["threads"])
    torch.set_default_dtype(saved["dtype"])
    torch.set_grad_enabled(saved["grad"])
    torch.set_rng_state(saved["torch_rng"])
    random.setstate(saved["random"])
    if saved["numpy"] is not None:
        sys.modules["numpy"].random.set_state(saved["numpy"])


def pooled(rank: int, world: int, out_dir: str) -> None:
    """Inside each rank of a pool's launch: every entry of ``$DS_DRAGONN_POOL`` ([target, folder, env], ...) in
    turn on one process group (their ``destroy_process_group`` deferred to the end), each rank function called
    as ``fn(rank, world, folder)`` with its env added; after each, what a fresh process would have
    (:func:`_process_state`) is put back and every rank waits for the others; then rank 0
    writes the entry's marker file. An entry that raises ends the launch (the other ranks may be in a
    collective of it)."""
    import torch.distributed as dist
    entries = json.loads(os.environ.pop(POOL_ENV))
    functions = [getattr(importlib.import_module(t.split(":")[0]), t.split(":")[1]) for t, _, _ in entries]
    fresh = _process_state()
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        for fn, (target, folder, env) in zip(functions, entries):
            print(f"[pool] {target} -> {folder}", flush=True)
            Path(folder).mkdir(parents=True, exist_ok=True)
            os.environ.update(env)
            fn(rank, world, folder)
            _restore_process_state(fresh)
            if dist.is_initialized():
                dist.barrier()
            if rank == 0:
                (Path(folder) / DONE).touch()
    finally:
        dist.destroy_process_group = destroy
    if dist.is_initialized():
        destroy()
