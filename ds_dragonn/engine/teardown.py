"""Orderly teardown at interpreter exit, so that a training script exits 0 on every rank.

The abort this prevents: ``terminate called without an active exception`` (rc -6), rare, under load, after
a script's last line. Its cause is upstream. ``destroy_process_group`` stops the worker threads of a gloo
process group only when nothing else references the group, and DeepSpeed's engines, ZeRO optimizers and
``deepspeed.utils.groups`` keep references to theirs. So those threads live on into interpreter
finalization. There, a gloo worker thread that drops the last reference to a tensor whose Python object
torch keeps alive (e.g. a temporary of ``all_gather_object``) must take the GIL to release it. CPython
≤ 3.13 answers a thread that takes the GIL during finalization with ``pthread_exit``, whose forced unwind
through a ``noexcept`` C++ frame calls ``std::terminate``. Upstream: pytorch/pytorch#38228 (the
mechanism), pytorch/pytorch#190489 (the decref guard in ``PyInterpreter.cpp`` checks ``Py_IsInitialized``
only), pytorch/pytorch PR #179291 (an atexit ``destroy_process_group``, abandoned), python/cpython
gh-87135 (3.14 blocks such threads instead). Seen here in the test harness (``tests/multiproc.py``
``DS_DRAGONN_RANK_DEBUG``) and in user-style scripts.

:func:`register` (called by ``ds_dragonn.initialize``) adds one ``atexit`` handler. ``atexit`` handlers
run while the interpreter is still whole. The handler:

1. destroys the process groups if the script did not (torch's registry; groups that nothing else
   references stop their threads now);
2. collects garbage, so that unreferenced engines release their groups;
3. waits, with the GIL released, until every gloo worker thread (``pt_gloo_runloop``) is blocked, i.e.
   idle, at most :data:`SETTLE_S` seconds. A worker that was descheduled between finishing a collective
   and releasing it then releases it while Python can still run its decref.

Everything is best effort and bounded. It never raises, and it never blocks on another rank: no collective
runs at exit, so a rank whose peers died still exits.

:func:`unhook` takes a live engine back to DeepSpeed's own (``ds_dragonn.disable(engine)``).
"""
from __future__ import annotations

import atexit
import gc
import os
import time
from typing import Any, List

#: longest wait for the gloo worker threads to go idle, seconds
SETTLE_S = 2.0
_POLL_S = 0.005
_WORKER_NAMES = ("pt_gloo_runloop",)
_registered = False


def register() -> None:
    """Register the exit handler once per process (idempotent)."""
    global _registered
    if not _registered:
        atexit.register(teardown)
        _registered = True


def teardown() -> None:
    """Steps 1–3 of the module docstring. Never raises."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exit must go on whatever state the groups are in
        pass
    gc.collect()
    settle_workers(SETTLE_S)


def worker_states() -> List[str]:
    """The scheduler state (``R``, ``S``, ``D``, ...) of each gloo worker thread of this process (Linux;
    empty elsewhere or when there is none)."""
    states = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return states
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() not in _WORKER_NAMES:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])  # the field after "(comm)"
        except OSError:  # the thread ended meanwhile
            continue
    return states


def settle_workers(limit_s: float) -> bool:
    """Sleep (GIL released) until every gloo worker thread was blocked at two polls in a row, at most
    ``limit_s`` seconds. Returns whether they settled (True also when there are none)."""
    deadline, calm = time.monotonic() + limit_s, 0
    while True:
        states = worker_states()
        calm = calm + 1 if all(s in ("S", "D") for s in states) else 0
        if calm >= 2 or not states:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)


def _ours(value: Any) -> bool:
    """Whether ``value`` is a function or bound method defined in this package (what a hook put on an instance)."""
    fn = getattr(value, "__func__", value)
    return callable(value) and str(getattr(fn, "__module__", "") or "").startswith("ds_dragonn.")


def unhook(engine: Any) -> List[str]:
    """Remove every instance-level override ds_dragonn put on ``engine``, its optimizer and the optimizer's
    overflow checker (the class's methods show through again), the optimizer step pre-hooks it registered,
    and ``engine.dragonn``. The engine then runs DeepSpeed's dense reductions; the hook's residuals are
    dropped (what they held is not applied). Call it between steps, on every rank.

    Returns:
        the names removed, as ``"Type.attr"`` (empty where the engine was not hooked).
    """
    hook = getattr(engine, "dragonn", None)
    optimizer = getattr(engine, "optimizer", None)
    removed = []
    for obj in (engine, optimizer, getattr(optimizer, "overflow_checker", None)):
        if obj is None or not hasattr(obj, "__dict__"):
            continue
        for name, value in list(vars(obj).items()):
            if _ours(value):
                delattr(obj, name)
                removed.append(f"{type(obj).__name__}.{name}")
    for part in (vars(hook).values() if hook is not None else ()):
        handle = getattr(part, "handle", None)  # e.g. the variance freeze's step pre-hook
        if handle is not None and callable(getattr(handle, "remove", None)):
            handle.remove()
            part.handle = None
            removed.append(f"{type(part).__name__}.handle")
    if "dragonn" in vars(engine):
        del engine.dragonn
        removed.append(f"{type(engine).__name__}.dragonn")
    return removed
