"""What the hook points share: the compressor, the residual store, the pipelines and the step transaction.

Each hook point (``stage0.py``: ZeRO stage 0, ``stage_1_and_2.py``: ZeRO stage 1/2) receives DeepSpeed's
flattened gradient buckets at a different method and owns only what differs there: how DeepSpeed's
averaging is reproduced and where the result goes. Beside the hook: the dense-or-compressed decision
(``decision.py``), the logs and monitor events (``reporting.py``) and the state (``state.py``). The
compress → exchange → decode → error-feedback order lives in ``ds_dragonn.pipeline`` alone.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional

import torch
from deepspeed.utils.logging import print_dist

from ..comm import build_backend
from ..comm.base import CommBackend
from ..compress import build_compressor
from ..config import CompressTarget, DragonnConfig
from ..exchange import Exchange, build_exchange
from ..feedback import ErrorFeedback
from ..momentum import LocalMomentum
from ..pipeline import CompressedAllreduce, ReduceStats
from ..policy import AutoPolicy
from ..schedule import UNDECIDED, DensitySchedule
from ..telemetry import Telemetry
from . import state
from .adam import adam_beta1, optimizer_lr
from .variance import VarianceFreeze
from .decision import BucketDecision
from .reporting import Reporter
from .steps import StepGuard, loss_scale, may_skip_steps
from .warmup import LrWarmupTracker, resolve_warmup_steps


class HookBase:
    """Per-engine DRAGONN state, installed as ``engine.dragonn``.

    Fields: the config (``cfg``); the compressor, error-feedback store and one pipeline per data-parallel
    group; the bucket decision (``decision``: auto policy, density schedule, segments); the reporter
    (``reporter``: logs, monitor, :class:`Telemetry` totals); the step transaction (``steps``); the buckets
    whose residual may hold unsent gradient (``pending``).
    """

    #: what the hook replaces, for the start-up line
    hook_name = "base"

    @property
    def exchange_name(self) -> str:
        """The exchange scheme this hook runs (``allgather``, ``partitioned`` or ``reduce_scatter``)."""
        return self.cfg.exchange.value

    def __init__(self, engine: Any, cfg: DragonnConfig):
        self.engine = engine
        # "auto": from the engine's learning-rate warm-up, or (unreadable) following the learning rate online
        self.cfg = cfg = resolve_warmup_steps(cfg, engine, follow=self.follows_lr)
        self.warmup_tracker = LrWarmupTracker() if cfg.warmup_steps == "auto" else None
        self.compressor = build_compressor(cfg)
        self.transactional = may_skip_steps(engine)  # fp16, bf16 + check_grad_overflow: steps may be skipped
        self.error_feedback = ErrorFeedback(cfg.error_feedback, transactional=self.transactional)
        self.steps = StepGuard(self._stores, lambda: getattr(engine, "skipped_steps", 0), lambda: loss_scale(engine))
        self.decision = BucketDecision(cfg)
        self.reporter = Reporter(engine, cfg, self.decision.schedule)
        self._pipelines: Dict[int, CompressedAllreduce] = {}
        self._round = None  # (step, micro step) of the ordinals being counted
        self._ordinal = 0
        self.pending: set = set()  # buckets whose residual may hold unsent gradient
        self._flushing: set = set()  # transactional: flushed in the open step (still pending if it is skipped)
        self.notes: list = []  # what loading a state did beyond restoring it (also logged as warnings)
        self.variance_freeze = None
        self.momentum: Optional[LocalMomentum] = None  # compress: momentum (this rank's local momentum)
        has_optimizer = engine is not None and hasattr(engine, "optimizer")
        if cfg.compress == CompressTarget.momentum:
            beta1 = adam_beta1(engine) if has_optimizer else None
            self.momentum = LocalMomentum(0.9 if beta1 is None else beta1, transactional=self.transactional)
            if has_optimizer:
                schedule = self.decision.schedule
                self.variance_freeze = VarianceFreeze(engine, schedule.warmup_steps, refresh=schedule.refresh,
                                                      refresh_steps=schedule.refresh_steps)

    @property
    def policy(self) -> AutoPolicy:
        """The auto policy's state (``decision.policy``)."""
        return self.decision.policy

    @property
    def schedule(self) -> DensitySchedule:
        """The warm-up and density schedule (``decision.schedule``)."""
        return self.decision.schedule

    @property
    def telemetry(self) -> Telemetry:
        """Running totals of the reductions (``reporter.telemetry``)."""
        return self.reporter.telemetry

    # -- pieces for the hook points ----------------------------------------------------------------
    def _build_exchange(self, backend: CommBackend) -> Exchange:
        return build_exchange(self.cfg, backend, self.compressor, transactional=self.transactional)

    def _stores(self) -> list:
        """Everything whose state a skipped step must not change: the workers' store, each pipeline's
        exchange, and this hook's record of which residuals still need a flush."""
        momentum = [self.momentum] if self.momentum is not None else []
        return [self.error_feedback] + momentum + [p.exchange for p in self._pipelines.values()] + [self]

    def _flushed(self, key: Hashable) -> None:
        """The residual of ``key`` went out with a dense reduction: no flush is owed any more (once the step
        is applied, where DeepSpeed may skip it)."""
        if self.transactional:
            self._flushing.add(key)
        else:
            self.pending.discard(key)

    def end_step(self, applied: bool) -> None:
        """Step transaction (``steps.StepGuard``): an applied step's flushes are done; a skipped step's are
        owed again (the residuals were restored)."""
        if applied:
            self.pending.difference_update(self._flushing)
        self._flushing.clear()

    def rescale_(self, factor: float) -> None:
        """Nothing of this hook's own is in gradient units (``steps.StepGuard`` store interface)."""

    def forget_round(self) -> None:
        """After a load or reset: no step transaction is open, bucket ordinals count from 0 again."""
        self.steps.abandon()
        self._flushing.clear()
        self._round, self._ordinal = None, 0

    def settle(self) -> None:
        """End the last step's residual transaction if DeepSpeed has finished that step."""
        if self.steps.finished(int(self.engine.global_steps)):
            self.steps.end()

    def pipeline(self, group: Any) -> CompressedAllreduce:
        """The (cached) pipeline of a data-parallel process group."""
        key = id(group)
        if key not in self._pipelines:
            self._apply_timeout(group)
            backend: CommBackend = build_backend(self.cfg, group)
            self._pipelines[key] = CompressedAllreduce(self.compressor, backend, self.error_feedback,
                                                       self._build_exchange(backend), self.momentum)
        return self._pipelines[key]

    def _apply_timeout(self, group: Any) -> None:
        """``comm_timeout_s`` on the data-parallel group (and the world group): DeepSpeed makes the group
        without a timeout, so torch's default applies to every gradient reduction, dense or compressed."""
        if self.cfg.comm_timeout_s is None:
            return
        import datetime

        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        if not (dist.is_available() and dist.is_initialized()):
            return
        timeout = datetime.timedelta(seconds=self.cfg.comm_timeout_s)
        setter = getattr(c10d, "_set_pg_timeout", None)  # torch >= 2.2 (private; checked by a test)
        if setter is None:
            print_dist("DRAGONN: this torch cannot change a process group's timeout; 'dragonn.comm_timeout_s' "
                       "applies to the world group only", ranks=[0])
            return
        for g in (group, None):  # None: the world group
            setter(timeout, g)

    def _next_ordinal(self, round_id: Hashable) -> int:
        """The bucket's position within its reduction round (reset when ``round_id`` changes)."""
        if round_id != self._round:
            self._round, self._ordinal = round_id, 0
        self._ordinal += 1
        return self._ordinal - 1

    def _carries_momentum(self, step: int) -> bool:
        """Momentum mode after the dense warm-up: every reduction of this step, dense ones included, sends
        the local momentum (the optimizer applies what arrives as the momentum itself)."""
        if self.momentum is None or self.decision.schedule.dense(step):
            return False
        if self.variance_freeze is not None:
            self.variance_freeze.arm()
        return True

    def _refreshes(self, step: int) -> bool:
        """Momentum mode: ``step`` refreshes Adam's frozen variance (``schedule.refresh``): every bucket is
        reduced densely as the raw gradient (:meth:`_hold_momentum` first), whatever the decision."""
        freeze = self.variance_freeze  # without its optimizer pre-hook nothing would zero the step's update
        return freeze is not None and freeze.active and self.momentum is not None and self.decision.schedule.refresh(step)

    def _hold_momentum(self, key: Hashable, tensors, dtype: torch.dtype, prescale: float) -> None:
        """A variance-refresh step, before DeepSpeed's dense reduction of the raw gradients: fold them into the
        local momentum and add this step's momentum to the residual, unsent (it goes out with later steps;
        transactional like every residual update)."""
        self.variance_freeze.arm()
        held, pre = self.momentum.update(key, tensors, dtype, prescale)
        self.error_feedback.compensate_(key, held, dtype, pre)
        self.pending.add(key)

    def _follow_optimizer(self) -> None:
        """At the start of every reduction: ``"warmup_steps": "auto"`` without a readable scheduler decides
        the end of the dense warm-up from this step's learning rate (``LrWarmupTracker``). Momentum mode: the
        local momentum follows the optimizer's current β1 (a scheduler may cycle it, e.g. OneCycle)."""
        tracker = self.warmup_tracker
        if tracker is not None and tracker.end is None:
            lr = optimizer_lr(self.engine) if hasattr(self.engine, "optimizer") else None
            if tracker.observe(int(self.engine.global_steps), lr) is not None:
                self._end_warmup(tracker.end, log=True)
        if self.momentum is None:
            return
        beta1 = adam_beta1(self.engine) if hasattr(self.engine, "optimizer") else None
        if beta1 is not None and 0.0 < beta1 < 1.0:
            self.momentum.beta = beta1

    def _track_momentum(self, pipeline: CompressedAllreduce, key: Hashable, tensors, dtype: torch.dtype,
                        prescale: float) -> None:
        """Momentum mode, dense warm-up: fold the local gradients into the local momentum (sent from the
        first compressed step on, so that it does not start from zero)."""
        if self.momentum is not None and tensors:
            self.momentum.update(key, tensors, dtype, prescale)

    def _record_dense(self, key: Hashable, numel: int, itemsize: int, world: int, ms: float, fixed: bool,
                      dense_bytes: Optional[int] = None) -> None:
        self.decision.record_dense(key, ms, fixed)
        self.reporter.dense(numel, itemsize, world, ms, dense_bytes)

    def _record_compressed(self, key: Hashable, stats: ReduceStats, pipeline: CompressedAllreduce, ordinal: int,
                           step: int, device: torch.device) -> None:
        if self.error_feedback.enabled:
            self.pending.add(key)
        if self.variance_freeze is not None:  # gradients are delayed from now on
            self.variance_freeze.arm()
        ms = stats.compress_ms + stats.exchange_ms + stats.decode_ms
        decided = self.decision.record_compressed(key, step, ms, pipeline.backend, device)
        if decided is not None:
            self.reporter.decided(ordinal, stats.numel, decided)
        self.reporter.compressed(stats, step)

    # -- state (engine/state.py) -------------------------------------------------------------------
    @property
    def pipelines(self) -> List[CompressedAllreduce]:
        """The pipelines built so far, one per data-parallel group, in creation order."""
        return list(self._pipelines.values())

    def where(self) -> tuple:
        """(rank, world size) of this hook's data-parallel group."""
        backend = next(iter(self._pipelines.values())).backend if self._pipelines else None
        if backend is not None:
            return backend.rank, backend.world_size
        import torch.distributed as dist  # before the first reduction (a save at step 0): DeepSpeed's group
        if dist.is_available() and dist.is_initialized():
            group = getattr(self.engine, "data_parallel_group", None)
            return dist.get_rank(group=group), dist.get_world_size(group=group)
        return 0, 1

    def state_dict(self) -> dict:
        """This rank's DRAGONN state: residuals (the partitioned exchange's server residuals too), the
        buckets that may hold unsent gradient, telemetry totals, and the description of the run they belong
        to (:func:`ds_dragonn.engine.state.describe`). Each rank holds its own: ``engine.save_checkpoint``
        writes one file per rank (``engine/checkpoint.py``)."""
        return state.state_dict(self)

    #: whether ``"warmup_steps": "auto"`` may follow the learning rate online (else: the scheduler or 30)
    follows_lr = True

    def _end_warmup(self, end: int, log: bool = False) -> None:
        """The dense warm-up decided online ends at step ``end``: the schedule and the variance freeze follow."""
        self.decision.schedule.warmup_steps = end
        if self.variance_freeze is not None:
            self.variance_freeze.freeze_step = end
        if log:
            rise = self.warmup_tracker.last_rise
            why = f"the learning rate rose until step {rise}" if rise else "the learning rate did not rise"
            ramp = self.decision.schedule
            then = (f"; then the density falls to {ramp.density:g} over {ramp.steps} steps" if ramp.steps else "")
            print_dist(f"DRAGONN: warmup_steps 'auto': {why}; the dense warm-up ends at step {end} "
                       f"(max(30, 2 x {rise})){then}", ranks=[0])

    def load_warmup_state(self, saved: Optional[dict]) -> None:
        """Restore the online warm-up decision (``state_dict()["warmup"]``) where this hook follows one."""
        if self.warmup_tracker is None:
            return
        self.warmup_tracker.load_state_dict(saved)
        self._end_warmup(UNDECIDED if self.warmup_tracker.end is None else self.warmup_tracker.end)

    def extra_state(self) -> dict:
        """Parts of this rank's state that only some hooks have (merged into :meth:`state_dict`)."""
        return {}

    def load_extra_state(self, saved: dict) -> None:
        """Restore :meth:`extra_state` from a saved state that applies here (after the residuals)."""

    def reset_extra_state(self) -> None:
        """:meth:`extra_state` starts afresh (a state that does not apply here, or a warm start)."""

    def restore_after_reset(self, saved: dict, reasons: List[str]) -> None:
        """A saved state was reset for ``reasons`` (``engine/state.py``): take from it what still applies."""

    def after_load(self, saved_worlds: List[Optional[int]]) -> None:
        """After every rank applied its state file (collective, on every rank): ``saved_worlds`` is each
        rank's saved world size (None: no file)."""

    def reset_state(self, why: str) -> None:
        """Start with empty residuals (and no pending flush), with a warning saying why."""
        state.reset_state(self, why)

    def load_state_dict(self, saved: dict, source: str = "the state") -> None:
        """Restore :meth:`state_dict` of this rank, by the rules of ``engine/state.py``: residuals saved by
        another rank, world size, model, bucketing or gradient scaling are reset, server residuals saved
        under another exchange are folded into the worker residuals, other setting changes keep them; each
        case logs a warning naming what differs. Any open step transaction is dropped and bucket ordinals
        count from 0 again (a load in the middle of a run starts a fresh round).

        Raises:
            ValueError: ``saved`` is not a valid DRAGONN state (:func:`~ds_dragonn.engine.state.validate`:
                a missing or malformed part, a newer format, a residual that is not a finite 1-D float tensor
                of its bucket's length and residual dtype), naming ``source`` and what is wrong.
        """
        state.load_state_dict(self, saved, source)
