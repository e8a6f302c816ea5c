"""What the hook points share: the compressor, the residual store, the pipelines and the step transaction.

Each hook point (``stage0.py``, ``stage_1_and_2.py``, ``stage3.py``) hands DeepSpeed's gradient buckets to the one
decision sequence, :class:`~ds_dragonn.engine.reducer.BucketReducer`, as its stage adapter. The compress →
exchange → decode → error-feedback order lives in ``ds_dragonn.pipeline`` alone.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, Optional

import torch
from deepspeed.utils.logging import print_dist

from ..comm import build_backend
from ..comm.base import CommBackend
from ..compress import build_compressor
from ..config import DragonnConfig
from ..exchange import Exchange, build_exchange
from ..exchange.reduce_scatter import ReduceScatterExchange
from ..feedback import ErrorFeedback
from ..momentum import LocalMomentum
from ..pipeline import CompressedAllreduce, ReduceStats
from ..plan import resolve_defaults
from ..policy import AutoPolicy
from ..schedule import DensitySchedule
from ..telemetry import Telemetry
from .checkpoint import install as install_checkpointing
from .decision import BucketDecision
from .follow import MODES, FollowsOptimizer, GradientMode
from .pipelines import FLAT, FlatLayout, build_pipeline
from .reducer import BucketReducer
from .hook_state import HookState
from .variance import VarianceFreeze
from .reporting import Reporter
from .steps import StepGuard, loss_scale, may_skip_steps, step_transaction
from .warmup import LrWarmupTracker, resolve_warmup_steps


class HookBase(FollowsOptimizer, HookState):
    """Per-engine DRAGONN state, installed as ``engine.dragonn``.

    Fields: the config (``cfg``); the compressor, error-feedback store and one pipeline per data-parallel
    group; the bucket decision (``decision``: auto policy, density schedule); the reporter (``reporter``:
    logs, monitor, :class:`Telemetry` totals); the step transaction (``steps``); the buckets whose residual
    may hold unsent gradient (``pending``); the mode (``mode``: ``compress`` gradient or momentum,
    :data:`~ds_dragonn.engine.follow.MODES`). The online warm-up is
    :class:`~ds_dragonn.engine.follow.FollowsOptimizer`'s, the state methods
    :class:`~ds_dragonn.engine.hook_state.HookState`'s.
    """

    #: what the hook replaces, for the start-up line
    hook_name = "base"
    #: whether ``hierarchy`` may resolve to the node-aware pipeline (engine/pipelines.py)
    supports_hierarchy = False
    #: flat or node-aware (``engine/pipelines.py``: :class:`FlatLayout` or :class:`NodeAware`), and the node
    #: layout of the node-aware pipeline (None: flat); both set when the first pipeline is built
    topology: FlatLayout = FLAT
    layout = None

    @property
    def exchange_name(self) -> str:
        """The exchange scheme this hook runs (``allgather``, ``partitioned`` or ``reduce_scatter``)."""
        return self.topology.exchange_name(self)

    @property
    def flat_exchange_name(self) -> str:
        """The scheme of the flat pipeline (:meth:`_flat_exchange`)."""
        return self.cfg.exchange.value

    def __init__(self, engine: Any, cfg: DragonnConfig):
        self.engine = engine
        cfg, _ = resolve_defaults(cfg, engine.zero_optimization_stage())  # (done at initialize: idempotent)
        # "auto": from the engine's learning-rate warm-up, or (unreadable) following the learning rate online
        self.cfg = cfg = resolve_warmup_steps(cfg, engine, follow=self.follows_lr)
        self.warmup_tracker = LrWarmupTracker() if cfg.warmup_steps == "auto" else None
        self.compressor = build_compressor(cfg)
        self.may_skip = may_skip_steps(engine)  # DeepSpeed may skip a step on overflow
        # skipped steps leave no trace (working copies: fp16) or return what they sent (an O(k) log): steps.py
        self.transactional = step_transaction(engine, cfg.exact_skipped_steps)
        self.error_feedback = ErrorFeedback(cfg.error_feedback, transactional=self.transactional, undo_sent=True)
        self.steps = StepGuard(self._stores, lambda: getattr(engine, "skipped_steps", 0), lambda: loss_scale(engine),
                               ticks=lambda step: self.decision.schedule.ticks(step))
        self.steps.exact = self.transactional
        self.decision = BucketDecision(cfg)
        self.reducer = BucketReducer(self)  # the decision sequence; this hook is its stage adapter
        self.reporter = Reporter(engine, cfg, self.decision.schedule)
        self._pipelines: Dict[int, CompressedAllreduce] = {}
        self._round = None  # (step, micro step) of the ordinals being counted
        self._ordinal = 0
        self.pending: set = set()  # buckets whose residual may hold unsent gradient
        self._flushing: set = set()  # steps may be skipped: flushed in the open step (still pending if it is)
        self.notes: list = []  # what loading a state did beyond restoring it (also logged as warnings)
        # compress: gradient or momentum, chosen once (follow.py); the momentum mode's local momentum and variance
        # freeze (None in the gradient mode) are the state's (state.py, checkpoint.py)
        self.mode = MODES.get(cfg.compress, GradientMode)(engine, self.decision.schedule, self.transactional)
        self.momentum: Optional[LocalMomentum] = self.mode.momentum
        self.variance_freeze: Optional[VarianceFreeze] = self.mode.variance_freeze

    def install(self) -> "HookBase":
        """Patch DeepSpeed's reduction (:meth:`_patch`), carry the residuals in ``engine.save_checkpoint`` /
        ``load_checkpoint`` and log the start-up line. The transport is built first, so that a wrong launch fails
        at initialize."""
        self.pipeline(self._dp_group())
        self._patch()
        self.engine.dragonn = self
        install_checkpointing(self)
        self.reporter.start(self.hook_name, self.compressor.name, self._scheme())
        return self

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
        """``exchange`` over ``backend`` (the flat group, or the ranks of this local index across nodes)."""
        return build_exchange(self.cfg, backend, self.compressor, transactional=self.may_skip)

    def _flat_exchange(self, backend: CommBackend) -> Exchange:
        """The exchange of the flat pipeline over the whole data-parallel group."""
        return self._build_exchange(backend)

    def _stores(self) -> list:
        """Everything whose state a skipped step must not change: the workers' stores (:meth:`residual_stores`),
        each pipeline's exchange, and this hook's record of which residuals still need a flush."""
        return self.residual_stores() + [p.exchange for p in self._pipelines.values()] + [self]

    def _flushed(self, key: Hashable) -> None:
        """The residual of ``key`` went out with a dense reduction: no flush is owed any more (once the step
        is applied, where DeepSpeed may skip it)."""
        if self.may_skip:  # owed again if the step is skipped (its residual restored, or what it sent returned)
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

    def age_clock(self, step: int) -> int:
        """The age bound's clock at ``step`` (``compress/age_bound.py``): its compressed index
        (``DensitySchedule.compressed_index``) less the compressed steps DeepSpeed skipped on overflow. Never
        below 0 (a resume may have shortened the warm-up or the refresh period)."""
        return max(0, self.schedule.compressed_index(step) - self.steps.skipped_ticks)

    def settle(self) -> None:
        """End the last step's residual transaction if DeepSpeed has finished that step."""
        if self.steps.finished(int(self.engine.global_steps)):
            self.steps.end()

    def before_disable(self) -> None:
        """Called on every rank by ``ds_dragonn.disable(engine)`` before the hook is removed; nothing here (the
        ranks hold the same weights)."""

    def pipeline(self, group: Any) -> CompressedAllreduce:
        """The (cached) pipeline of a data-parallel process group."""
        key = id(group)
        if key not in self._pipelines:
            self._apply_timeout(group)
            backend: CommBackend = build_backend(self.cfg, group)
            self._pipelines[key] = build_pipeline(self, backend)  # flat, or node-aware (hierarchy)
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

    def _record_dense(self, key: Hashable, numel: int, itemsize: int, world: int, ms: float, fixed: bool,
                      dense_bytes: Optional[int] = None, quantized_bytes: Optional[int] = None) -> None:
        self.decision.record_dense(key, ms, fixed)
        self.reporter.dense(numel, itemsize, world, ms, dense_bytes, quantized_bytes)

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


class ZeroPartitionHook(HookBase):
    """A ZeRO 1-3 hook's exchange: flat, the sparse reduce-scatter to ZeRO's partition owners, whatever
    ``exchange`` says; node-aware, ``exchange`` (allgather/partitioned) for the shard across nodes, whose node
    sum then gives each owner its slices (``topology``: ``engine/pipelines.py``)."""

    supports_hierarchy = True  # engine/pipelines.py: owners take their slices of the node-aware result
    flat_exchange_name = "reduce_scatter"

    def __init__(self, engine: Any, cfg: DragonnConfig):
        super().__init__(engine, cfg)
        self.optimizer = engine.optimizer

    def _dp_group(self) -> Any:
        return self.optimizer.dp_process_group

    def _scheme(self) -> str:
        return self.topology.scheme(self)

    def _flat_exchange(self, backend: CommBackend) -> Exchange:
        return ReduceScatterExchange(backend)
