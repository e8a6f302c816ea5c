"""What the hook points share: the compressor, the residual store, the pipelines, the auto policy, the
telemetry, and the per-bucket decision (dense or compressed) with its logging.

Each hook point (``stage0.py``: ZeRO stage 0, ``zero.py``: ZeRO stage 1/2) receives DeepSpeed's
flattened gradient buckets at a different method and owns only what differs there: how DeepSpeed's
averaging is reproduced and where the result goes. The compress → exchange → decode → error-feedback
order lives in ``ds_dragonn.pipeline`` alone.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, Hashable, Optional

import torch
from deepspeed.utils import logger
from deepspeed.utils.logging import print_dist

from ..comm import build_backend
from ..comm.base import CommBackend
from ..compress import build_compressor, max_pairs, target_k
from ..compress.segments import Segments, plan_segments
from ..config import DragonnConfig, Policy, SelectionScope
from ..exchange import Exchange, build_exchange
from ..feedback import ErrorFeedback
from ..pipeline import CompressedAllreduce, ReduceStats
from ..policy import AutoPolicy
from ..schedule import DensitySchedule
from ..telemetry import Telemetry, log_reduction, monitor_events
from ..exchange.ownership import HashedOwnership
from .checkpoint import compare, describe, validate
from .steps import StepGuard, loss_scale, may_skip_steps


def bucket_seed(seed: int, step: int, ordinal: int) -> int:
    """Seed for (step, bucket): the same on every rank, different every step (paper: per-step hash seed)."""
    return (seed * 1_000_003 + step * 7919 + ordinal) & 0xFFFF_FFFF_FFFF


class HookBase:
    """Per-engine DRAGONN state, installed as ``engine.dragonn``.

    Fields: the config (``cfg``); the compressor, error-feedback store and one pipeline per data-parallel
    group; the bucket ordinal within the current reduction round; :class:`Telemetry` totals; the auto
    policy's state.
    """

    #: what the hook replaces, for the start-up line
    hook_name = "base"

    @property
    def exchange_name(self) -> str:
        """The exchange scheme this hook runs (``allgather``, ``partitioned`` or ``reduce_scatter``)."""
        return self.cfg.exchange.value

    def __init__(self, engine: Any, cfg: DragonnConfig):
        self.engine = engine
        self.cfg = cfg
        self.compressor = build_compressor(cfg)
        self.transactional = may_skip_steps(engine)  # fp16, bf16 + check_grad_overflow: steps may be skipped
        self.error_feedback = ErrorFeedback(cfg.error_feedback, transactional=self.transactional)
        self.steps = StepGuard(self._stores, lambda: getattr(engine, "skipped_steps", 0), lambda: loss_scale(engine))
        self.telemetry = Telemetry()
        self._pipelines: Dict[int, CompressedAllreduce] = {}
        self._round = None  # (step, micro step) of the ordinals being counted
        self._ordinal = 0
        self._warned_small = False
        self._announced = False  # the switch to compression was logged
        self._pending: set = set()  # buckets whose residual may hold unsent gradient
        self._flushing: set = set()  # transactional: flushed in the open step (still pending if it is skipped)
        self._costly: Dict[Hashable, bool] = {}  # bucket key -> its pairs may cost more than dense
        self.notes: list = []  # what loading a state did beyond restoring it (also logged as warnings)
        self.policy = AutoPolicy(cfg.auto_probe_steps, cfg.auto_recheck_interval,
                                 always=cfg.policy == Policy.always)
        self.schedule = DensitySchedule.from_config(cfg)
        self.variance_freeze = None
        # only where gradients are delayed (density below 1, error feedback on: bursts), and only after dense
        # warm-up steps: a variance estimated from sparse steps is ~0 where nothing arrived yet (measured:
        # the LM diverges when frozen at the end of the density warm-up without dense steps)
        if (cfg.freeze_adam_variance and cfg.density < 1.0 and cfg.error_feedback and cfg.warmup_steps > 0
                and engine is not None and hasattr(engine, "optimizer")):
            from .adam import VarianceFreeze
            self.variance_freeze = VarianceFreeze(engine, cfg.warmup_steps)
        self._segments: Dict[Hashable, Optional[Segments]] = {}  # bucket key -> its per-tensor segments

    # -- pieces for the hook points ----------------------------------------------------------------
    def _build_exchange(self, backend: CommBackend) -> Exchange:
        return build_exchange(self.cfg, backend, self.compressor, transactional=self.transactional)

    def _stores(self) -> list:
        """Everything whose state a skipped step must not change: the workers' store, each pipeline's
        exchange, and this hook's record of which residuals still need a flush."""
        return [self.error_feedback] + [p.exchange for p in self._pipelines.values()] + [self]

    def _flushed(self, key: Hashable) -> None:
        """The residual of ``key`` went out with a dense reduction: no flush is owed any more (once the step
        is applied, where DeepSpeed may skip it)."""
        if self.transactional:
            self._flushing.add(key)
        else:
            self._pending.discard(key)

    def end_step(self, applied: bool) -> None:
        """Step transaction (``steps.StepGuard``): an applied step's flushes are done; a skipped step's are
        owed again (the residuals were restored)."""
        if applied:
            self._pending -= self._flushing
        self._flushing.clear()

    def rescale_(self, factor: float) -> None:
        """Nothing of this hook's own is in gradient units (``steps.StepGuard`` store interface)."""

    def _forget_round(self) -> None:
        """After a load or reset: no step transaction is open, bucket ordinals count from 0 again."""
        self.steps.abandon()
        self._flushing.clear()
        self._round, self._ordinal = None, 0

    def _settle(self) -> None:
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
                                                       self._build_exchange(backend))
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
            print_dist(f"DRAGONN: this torch cannot change a process group's timeout; 'dragonn.comm_timeout_s' "
                       f"applies to the world group only", ranks=[0])
            return
        for g in (group, None):  # None: the world group
            setter(timeout, g)

    def _next_ordinal(self, round_id: Hashable) -> int:
        """The bucket's position within its reduction round (reset when ``round_id`` changes)."""
        if round_id != self._round:
            self._round, self._ordinal = round_id, 0
        self._ordinal += 1
        return self._ordinal - 1

    def _goes_dense(self, key: Hashable, numel: int, step: int, pipeline: CompressedAllreduce,
                    dtype: torch.dtype, dense_bytes: Optional[int] = None) -> tuple:
        """(dense?, fixed?) for this bucket. Dense: below ``min_compress_numel``, in the warm-up, pairs that
        would cost more bytes than the dense collective (policy ``auto``), or the auto policy's timing
        choice. ``fixed``: the reason does not depend on timings (the policy does not time it). Every rank
        decides the same: step, size, dtype, world size, config and the agreed policy state."""
        small = numel < max(self.cfg.min_compress_numel, 1)
        if small and not self._warned_small:
            self._warned_small = True
            print_dist(f"DRAGONN: a gradient bucket of {numel} elements is below min_compress_numel="
                       f"{self.cfg.min_compress_numel}: it uses DeepSpeed's dense path (lower "
                       f"'dragonn.min_compress_numel' to compress it)", ranks=[0])
        costly = not small and self._pairs_cost_more(key, numel, pipeline, dtype, dense_bytes)
        warm = self.schedule.dense(step)
        fixed = small or (costly and self.cfg.policy == Policy.auto)
        return fixed or warm or not self.policy.compress(key), fixed

    def _pairs_cost_more(self, key: Hashable, numel: int, pipeline: CompressedAllreduce, dtype: torch.dtype,
                         dense_bytes: Optional[int]) -> bool:
        """Whether this rank's pairs may cost more bytes than the dense collective (at most
        ``max_pairs(k)`` pairs through the exchange, e.g. bf16 values + int32 indices at density 1.0: ~3x
        a bf16 allreduce). Decided once per bucket and logged on rank 0."""
        hit = self._costly.get(key)
        if hit is None:
            world = pipeline.backend.world_size
            segments = self._segments.get(key)  # at the target density: the density warm-up is transient
            pairs = max_pairs(sum(segments.ks(self.cfg.density)) if segments is not None
                              else target_k(numel, self.cfg.density))
            most = pipeline.exchange.max_bytes(numel, pairs, dtype, world)
            dense = pipeline.exchange.dense_bytes(numel, dtype.itemsize, world) if dense_bytes is None else dense_bytes
            hit = self._costly[key] = most > dense
            if hit:
                what = ("it uses the dense path (policy 'auto')" if self.cfg.policy == Policy.auto else
                        "it is compressed anyway (policy 'always')")
                print_dist(f"DRAGONN: at density {self.cfg.density} the pairs of a {numel}-element "
                           f"{str(dtype).replace('torch.', '')} bucket may cost {most} bytes per rank, more than "
                           f"the dense collective's {dense}: {what}", ranks=[0])
        return hit

    def _bucket_segments(self, key: Hashable, numel: int, shapes) -> Optional[Segments]:
        """The per-tensor segments of bucket ``key`` (None: global selection), planned once per key from
        ``shapes()``, its tensors' shapes in bucket order (called only then, and only for per-tensor
        selection); None too where they do not add up to ``numel`` (padding). Logged once."""
        if key not in self._segments:
            seg = None
            if self.cfg.selection == SelectionScope.per_tensor:
                seg = plan_segments(shapes(), self.cfg.tensor_min_compress_numel, self.cfg.compress_1d)
                if seg.numel != numel:
                    seg = None
                elif not any(s is not None for s in self._segments.values()):
                    print_dist(f"DRAGONN: per-tensor selection, first bucket: {seg.describe()}", ranks=[0])
            self._segments[key] = seg
        return self._segments[key]

    def _set_density(self, step: int) -> None:
        """The compressor's density for this step (the density warm-up); the same on every rank."""
        d = self.schedule.at(step)
        if d is not None and d != self.compressor.density:
            self.compressor.density = d

    def _record_dense(self, key: Hashable, numel: int, itemsize: int, world: int, ms: float, fixed: bool,
                      dense_bytes: Optional[int] = None) -> None:
        if not fixed:
            self.policy.record_dense(key, ms)
        self.telemetry.record_dense(numel, itemsize, world, ms, dense_bytes)
        self._monitor(None, ms)

    def _announce(self, step: int) -> None:
        if self._announced:
            return
        self._announced = True
        if self.cfg.policy == Policy.auto:
            print_dist(f"DRAGONN auto: compressing from step {step + 1} (schedule: {self.schedule.describe()}); "
                       f"the compressed path is timed at the target density and the decision follows after "
                       f"{self.cfg.auto_probe_steps} such steps", ranks=[0])
        else:
            print_dist(f"DRAGONN: compressing from step {step + 1}; schedule: {self.schedule.describe()}",
                       ranks=[0])

    def _record_compressed(self, key: Hashable, stats: ReduceStats, pipeline: CompressedAllreduce, ordinal: int,
                           step: int, device: torch.device) -> None:
        if self.error_feedback.enabled:
            self._pending.add(key)
        if self.variance_freeze is not None:  # gradients are delayed from now on
            self.variance_freeze.arm()
        self.telemetry.record_compressed(stats)
        total_ms = stats.compress_ms + stats.exchange_ms + stats.decode_ms
        # the auto policy times the compressed path at its target density, after the density warm-up
        if not self.schedule.warming(step) and self.policy.record_compressed(key, total_ms):
            compress, dense_ms, comp_ms = self.policy.decide(key, pipeline.backend, device)
            print_dist(f"DRAGONN auto: bucket {ordinal} ({stats.numel} elements) dense {dense_ms:.2f} ms, compressed "
                       f"{comp_ms:.2f} ms -> {'compress' if compress else 'dense'}"
                       f"{f' (re-check in {self.cfg.auto_recheck_interval} steps)' if self.cfg.auto_recheck_interval else ''}",
                       ranks=[0])
        if self.cfg.log_interval and self.telemetry.compressed_reductions % self.cfg.log_interval == 0:
            # 1-based like DeepSpeed's own step logs (global_steps is incremented after engine.step())
            log_reduction(step + 1, stats)
        self._monitor(stats)

    def _log_start(self, exchange: str) -> None:
        cfg = self.cfg
        print_dist(f"DRAGONN enabled ({self.hook_name}): compressor={self.compressor.name} density={cfg.density} "
                   f"kernel={getattr(cfg.kernel, 'value', cfg.kernel)} "
                   f"sample_ratio={cfg.sample_ratio} table_factor={cfg.table_factor} "
                   f"min_compress_numel={cfg.min_compress_numel} selection={cfg.selection.value}"
                   f"{f' (tensor_min_compress_numel={cfg.tensor_min_compress_numel} compress_1d={cfg.compress_1d})' if cfg.selection == SelectionScope.per_tensor else ''} "
                   f"schedule: {self.schedule.describe()}; "
                   f"error_feedback={cfg.error_feedback} comm_backend={cfg.comm_backend.value} "
                   f"exchange={exchange} policy={cfg.policy.value}"
                   f"{f' (probe {cfg.auto_probe_steps} steps, re-check every {cfg.auto_recheck_interval})' if cfg.policy == Policy.auto else ''}",
                   ranks=[0])

    def _monitor(self, stats: Optional[ReduceStats], dense_ms: Optional[float] = None) -> None:
        monitor = getattr(self.engine, "monitor", None)
        if monitor is None or not getattr(monitor, "enabled", False):
            return
        # DeepSpeed's x-axis: the global samples its Train/Samples/* events of this step will carry
        samples = int(getattr(self.engine, "global_samples", 0)) + int(self.engine.train_batch_size())
        monitor.write_events(monitor_events(self.telemetry, samples, stats, dense_ms))

    # -- state --------------------------------------------------------------------------------------
    def _where(self) -> tuple:
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
        to (:func:`ds_dragonn.engine.checkpoint.describe`). Each rank holds its own: ``engine.save_checkpoint``
        writes one file per rank (``engine/checkpoint.py``)."""
        self._settle()
        desc = describe(self)
        return {"description": desc, "rank": desc["rank"], "world_size": desc["world_size"],
                "error_feedback": self.error_feedback.state_dict(),
                "exchange": [p.exchange.state_dict() for p in self._pipelines.values()],
                "pending": list(self._pending), "telemetry": asdict(self.telemetry),
                "loss_scale_units": self.steps.units}

    def reset_state(self, why: str) -> None:
        """Start with empty residuals (and no pending flush), with a warning saying why."""
        rank, _ = self._where()
        self._note(f"[rank {rank}] DRAGONN: residuals start empty: {why}")
        self.error_feedback.reset()
        for pipe in self._pipelines.values():
            pipe.exchange.reset()
        self._pending = set()
        self._forget_round()

    def load_state_dict(self, state: dict, source: str = "the state") -> None:
        """Restore :meth:`state_dict` of this rank, by the rules of ``engine/checkpoint.py``: residuals
        saved by another rank, world size, model, bucketing or gradient scaling are reset, server residuals
        saved under another exchange are folded into the worker residuals, other setting changes keep them;
        each case logs a warning naming what differs. Any open step transaction is dropped and bucket
        ordinals count from 0 again (a load in the middle of a run starts a fresh round).

        Raises:
            ValueError: ``state`` is not a valid DRAGONN state (:func:`~ds_dragonn.engine.checkpoint.validate`:
                a missing or malformed part, a newer format, a residual that is not a finite 1-D float tensor
                of its bucket's length and residual dtype), naming ``source`` and what is wrong.
        """
        rank, world = self._where()
        validate(state, f"[rank {rank}] DRAGONN: {source}")
        saved = state.get("description") or {"rank": state.get("rank"), "world_size": state.get("world_size")}
        residuals = state["error_feedback"].get("residuals", {})
        if "description" in state:
            reset, fold, kept = compare(saved, describe(self))
        else:  # a bare state (rank and world size only)
            reset = [] if (saved["rank"], saved["world_size"]) == (rank, world) else \
                [f"saved by rank {saved['rank']} of {saved['world_size']} not loaded into rank {rank} of {world}"]
            fold, kept = [], []
        if reset:
            self.reset_state(f"{source} does not apply here: " + "; ".join(reset))
            return
        self._forget_round()
        self.error_feedback.load_state_dict(state["error_feedback"], getattr(self.engine, "device", None))
        exchanges = state.get("exchange", [])
        for pipe in self._pipelines.values():
            pipe.exchange.reset()
        if fold:
            self._fold_server_residuals(exchanges)
            self._note(f"[rank {rank}] DRAGONN: {'; '.join(fold)}: this rank's server residuals from {source} "
                       f"were added into its worker residuals (exact: the same unsent sum)")
        elif exchanges and len(exchanges) == len(self._pipelines):
            for pipe, ex_state in zip(self._pipelines.values(), exchanges):
                pipe.exchange.load_state_dict(ex_state, getattr(self.engine, "device", None))
        self._pending = set(state.get("pending") or ()) | set(residuals)
        # the fp16 loss scale the residuals are in (rescaled at the next reduction if the scale differs)
        self.steps.units = state.get("loss_scale_units")
        for field, value in (state.get("telemetry") or {}).items():
            if hasattr(self.telemetry, field) and isinstance(value, (int, float)):
                setattr(self.telemetry, field, value)
        if kept:
            self._note(f"[rank {rank}] DRAGONN: {source} was saved with {'; '.join(kept)}; its residuals are "
                       f"kept (unsent gradients, in the same units whatever these settings)")

    def _note(self, message: str) -> None:
        self.notes.append(message)
        logger.warning(message)

    def _fold_server_residuals(self, exchanges: list) -> None:
        """Add saved partitioned-exchange server residuals into the worker residuals of the same buckets, at
        the indices this rank owned (the owner map of the saved world size, which equals this one)."""
        rank, world = self._where()
        for ex_state in exchanges:
            numels = ex_state.get("numel", {})
            for key, part in ex_state.get("server", {}).get("residuals", {}).items():
                if key not in numels or not part.numel():
                    continue
                own = HashedOwnership(numels[key], world)
                worker = self.error_feedback.residuals.get(key)
                if worker is None:
                    device = getattr(self.engine, "device", None) or part.device
                    worker = self.error_feedback.residuals[key] = torch.zeros(numels[key], dtype=part.dtype,
                                                                              device=device)
                idx = own.to_index(rank, torch.arange(part.numel(), device=worker.device))
                worker.index_add_(0, idx, part.to(worker))
