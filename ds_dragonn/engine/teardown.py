"""Orderly teardown at interpreter exit, so that a training script exits 0 on every rank.

The abort this prevents: ``terminate called without an active exception`` (rc -6) after a script's last line. gloo
worker threads outlive ``destroy_process_group`` while DeepSpeed still references their groups; a thread that
takes the GIL during finalization gets ``pthread_exit`` (CPython ≤ 3.13), whose unwind through a ``noexcept`` frame
calls ``std::terminate``. Upstream: pytorch/pytorch#38228, pytorch/pytorch#190489, pytorch/pytorch PR #179291,
python/cpython gh-87135.

:func:`register` (called by ``ds_dragonn.initialize``) adds one ``atexit`` handler, which (1) destroys the process
groups, (2) collects garbage, (3) waits, GIL released, until every gloo worker thread (``pt_gloo_runloop``) is idle,
at most :data:`SETTLE_S` seconds. Best effort and bounded: it never raises and runs no collective.

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
