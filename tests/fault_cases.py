"""Rank functions for tests/test_faults.py: a job in which one rank dies (or hangs) mid-run.

Each function is called as ``fn(rank, world_size, out_dir)`` by the launcher in tests/test_faults.py (same
environment as ``tests.multiproc.run_ranks``: RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, gloo over
loopback). Every rank trains the same seeded MLP through ``ds_dragonn.initialize`` (ZeRO stage 0, DRAGONN at
density 0.01, policy "always", min_compress_numel 1, so every gradient reduction is a compressed exchange)
for :data:`STEPS_BEFORE_FAULT` steps; then the faulty rank (:data:`BAD_RANK`) stops after the forward pass of
the next step, before its backward (which holds the gradient exchange):

* ``exit``:  ``os._exit(3)``: the process is gone at once (no Python clean-up), like a crash or an OOM kill;
* ``raise``: an uncaught exception: the interpreter unwinds and exits 1 (process group not destroyed);
* ``hang``:  ``time.sleep`` forever: alive, its sockets open, but it never enters the collective.

The others carry on and must fail (non-zero exit with an error message), never finish and never hang.
Progress lines go to stdout (the rank's log): ``STEP <n> ok compressed=<count>`` after each step, and
``FINISHED`` only when a rank completed every step (which a survivor must not).
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Callable, Optional

import torch

from tests.engines import PINNED

BAD_RANK = 1
STEPS_BEFORE_FAULT = 3
TOTAL_STEPS = 10
LAYERS = (32, 64, 4)


def dragonn_config(comm_backend: str = "torch", **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
            "zero_optimization": {"stage": 0}, "steps_per_print": 10**6,
            "dragonn": {"enabled": True, "density": 0.01, "min_compress_numel": 1, "policy": "always", **PINNED,
                        "comm_backend": comm_backend, **extra}}


def say(rank: int, msg: str) -> None:
    print(f"[fault rank {rank}] {msg}", flush=True)


def train_with_fault(rank: int, mode: str, comm_backend: str = "torch", bad_rank: int = BAD_RANK,
                     on_step: Optional[Callable[[int], None]] = None,
                     on_engine: Optional[Callable[[object], None]] = None, **extra) -> None:
    """The training loop; ``rank == bad_rank`` misbehaves (``mode``) before the backward of step
    ``STEPS_BEFORE_FAULT + 1``; ``on_engine(engine)`` after initialize, ``on_step(step)`` after each completed step. Under torch.distributed the
    process group may already be started (else ``ds_dragonn.initialize`` starts it)."""
    import ds_dragonn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.Tanh(),
                                torch.nn.Linear(LAYERS[1], LAYERS[2]))
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(),
                                       config=dragonn_config(comm_backend, **extra))
    if on_engine is not None:
        on_engine(engine)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, TOTAL_STEPS + 1):
        x = torch.randn(8, LAYERS[0], generator=g)
        y = torch.randint(0, LAYERS[2], (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        if rank == bad_rank and step == STEPS_BEFORE_FAULT + 1:
            say(rank, f"FAULT {mode} before the backward of step {step}")
            if mode == "exit":
                os._exit(3)
            elif mode == "raise":
                raise RuntimeError("deliberate failure of the faulty rank")
            elif mode == "hang":
                while True:
                    time.sleep(3600)
            raise ValueError(f"unknown mode {mode!r}")
        engine.backward(loss)
        engine.step()
        say(rank, f"STEP {step} ok compressed={engine.dragonn.telemetry.compressed_reductions}")
        if on_step is not None:
            on_step(step)
    say(rank, "FINISHED")  # a survivor reaching this line completed steps without the faulty rank


def _start_gloo(timeout_s: float | None = None) -> None:
    import deepspeed
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    deepspeed.init_distributed(dist_backend="gloo", verbose=False, **kwargs)


# -- entry points (fn(rank, world_size, out_dir)) ----------------------------------------------------------
def rank_exits(rank: int, world: int, out_dir: str) -> None:
    _start_gloo()
    train_with_fault(rank, "exit")


def rank_raises(rank: int, world: int, out_dir: str) -> None:
    _start_gloo()
    train_with_fault(rank, "raise")


#: the collective timeout the hang cases ask for
HANG_TIMEOUT_S = 10


def rank_hangs_config_timeout(rank: int, world: int, out_dir: str) -> None:
    """Rank 1 hangs (alive) with ``"comm_timeout_s": 10`` in the "dragonn" block: ds_dragonn sets it on the
    world group and on DeepSpeed's data-parallel group (which DeepSpeed makes without a timeout, so torch's
    30 min gloo default would apply to every gradient reduction)."""
    _start_gloo()
    train_with_fault(rank, "hang", on_engine=_record_group_timeouts(rank), comm_timeout_s=HANG_TIMEOUT_S)


def _record_group_timeouts(rank: int) -> Callable:
    """``on_engine`` callback: prints the world group's and the data-parallel group's gloo timeouts."""
    def record(engine):
        import torch.distributed as dist
        from deepspeed.utils import groups

        def timeout(group):
            try:
                return str(group._get_backend(torch.device("cpu")).options._timeout)
            except Exception as err:  # noqa: BLE001 - private API; report what happened instead
                return f"unknown ({type(err).__name__})"
        say(rank, f"TIMEOUTS world={timeout(dist.group.WORLD)} "
                  f"data_parallel={timeout(groups._get_sequence_data_parallel_group())}")
    return record
