"""``sync: local_steps``: ranks train alone between syncs and exchange a compressed pseudo-gradient every H
optimizer steps (DiLoCo, Douillard et al. 2023; SparseLoCo, 2025), at ZeRO stage 0.

Hook points (DeepSpeed 0.19.8 ``runtime/engine.py``), overridden on the engine *instance*: ``allreduce_gradients``
(DeepSpeed's own during the dense warm-up, afterwards nothing; node-aware: the average inside the node,
``engine/local_nodes.py``), ``clip_fp32_gradients`` and the overflow check (each rank's own after the warm-up), and
``step`` (DeepSpeed's, then the outer step on the fp32 masters when a round ends). The unsent Δ stays in the
rank's own weights (error reset, CSER: Xie et al., NeurIPS 2020). See docs/design.md, 'Local steps:
``"sync": "local_steps"``'.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from deepspeed.utils.logging import print_dist

from ..constants import SEED
from ..feedback import ErrorFeedback, segment_views
from ..outer import OuterStep, outer_lr_for
from ..pipeline import PhaseClock
from .adam import base_optimizer
from .base import HookBase
from .bucket import OUTER, BucketKey, bucket_seed
from .checkpoint import install as install_checkpointing
from .local_norms import install_local_norms
from .local_resume import dense_again, keep_outer, load_replica, replica_state, restart_from_outer
from .local_weights import (copy_rank0_, holds_in_weights, kept_in_weights, masters_of, masters_to_model,
                            shapes_digest, subtract_)


#: keys of the per-step exchange that an outer step does not use (warned about when given)
IGNORED_KEYS = ("policy", "min_compress_numel", "density_warmup_steps", "density_warmup_start")


class LocalStepsUnsupported(ValueError):
    """The engine's optimizer does not keep a full fp32 copy of the weights on every rank."""


class LocalStepsHook(HookBase):
    """ZeRO stage 0 with ``sync: local_steps`` (module docstring); installed as ``engine.dragonn``."""

    hook_name = "ZeRO stage 0, local steps"
    follows_lr = False  # its rounds are laid out from warmup_steps: "auto" reads the scheduler (else 30)
    supports_hierarchy = True  # node-aware: each node one DiLoCo worker (engine/local_nodes.py)

    def __init__(self, engine: Any, cfg):
        super().__init__(engine, cfg)
        # the outer step runs after DeepSpeed has applied or skipped the step: nothing to undo
        self.transactional = False
        self.error_feedback = ErrorFeedback(cfg.error_feedback, transactional=False)
        self.outer = OuterStep()  # plain outer SGD (outer momentum measured worse); its lr is resolved at install
        self._dense_allreduce_gradients = engine.allreduce_gradients
        self._engine_step = engine.step
        self.group = None
        self._moved: Optional[str] = None  # a loaded state's other node layout (restore_after_reset -> after_load)
        self.optimizer = base_optimizer(engine)
        _check_optimizer(engine, self.optimizer, self.masters)
        # the masters hold θ_outer − residual (the last round kept its unsent Δ in the weights; saved with the state)
        self.held = False

    def install(self) -> "LocalStepsHook":
        from deepspeed.utils import groups
        self.group = groups._get_sequence_data_parallel_group()
        self.pipeline(self.group)  # the transport now: a wrong launch fails at initialize
        self.outer = OuterStep(self.outer_lr)  # "auto" needs the workers: the pipeline has set the node layout
        self.engine.allreduce_gradients = self.allreduce_gradients
        self.engine.step = self.step
        install_local_norms(self.engine, self._local)
        self.engine.dragonn = self
        install_checkpointing(self)
        cfg = self.cfg
        sent = ("in a dense allreduce" if cfg.density >= 1.0 else
                f"at density {cfg.density} (compressor={self.compressor.name} kernel={cfg.kernel.value} "
                f"exchange={cfg.exchange.value} values={getattr(cfg.values, 'value', cfg.values)} "
                f"error_feedback={cfg.error_feedback})")
        auto = f", auto: √{self.workers} workers" + ("" if cfg.density >= 1.0 else ", at least 2 for a compressed Δ")
        lr = f"{self.outer_lr:.4g}" + (auto if cfg.outer_lr == "auto" else "")
        print_dist(f"DRAGONN enabled ({self.hook_name}): {cfg.warmup_steps} dense warm-up steps, then an outer "
                   f"step every {cfg.local_steps} optimizer steps (outer_lr={lr}); the "
                   f"pseudo-gradient goes out {sent}; comm_backend={cfg.comm_backend.value}", ranks=[0])
        self.topology.announce(cfg.local_steps)
        ignored = cfg.given(*IGNORED_KEYS)
        if ignored:
            from deepspeed.utils import logger
            logger.warning("DRAGONN: under 'sync': 'local_steps' these keys have no effect (they shape the per-step "
                           "exchange): " + ", ".join(f"'dragonn.{k}'" for k in ignored))
        return self

    @property
    def workers(self) -> int:
        """DiLoCo's workers: the nodes when node-aware (known after :meth:`install`), else the data-parallel ranks."""
        return self.topology.workers(self)

    @property
    def outer_lr(self) -> float:
        """``outer_lr`` resolved for :attr:`workers` (``outer.outer_lr_for``)."""
        return outer_lr_for(self.cfg.outer_lr, self.workers, self.cfg.density)

    def _local(self) -> bool:
        """Between syncs: the rounds have started (the dense warm-up is over)."""
        return self.outer.started and int(self.engine.global_steps) >= self.cfg.warmup_steps

    # -- the weights (engine/local_weights.py) ------------------------------------------------------
    def masters(self) -> List[torch.Tensor]:
        """The fp32 master weights the optimizer steps on, in its parameter order."""
        return masters_of(self.optimizer)

    def _masters_to_model(self) -> None:
        masters_to_model(self.engine)

    # -- the hooks ---------------------------------------------------------------------------------
    def allreduce_gradients(self, *args, **kwargs):
        """DeepSpeed's gradient allreduce during the dense warm-up; afterwards nothing, or node-aware the
        gradients' average inside the node (``local_nodes.node_average_``) at each accumulation boundary."""
        step = int(self.engine.global_steps)
        if self.decision.schedule.dense(step):
            if self.engine.is_gradient_accumulation_boundary():
                clock = PhaseClock(self.engine.device)
                out = self._dense_allreduce_gradients(*args, **kwargs)
                numel, itemsize, world = self._dense_size()
                self.reporter.dense(numel, itemsize, world, clock.lap())
                return out
            return self._dense_allreduce_gradients(*args, **kwargs)
        self.topology.between_syncs(self)  # node-aware: the node's average (engine/pipelines.py NodeAware)
        return None

    def step(self, *args, **kwargs):
        """DeepSpeed's ``step``, then the outer step when this one ends a round. The first local step starts the
        first round from the weights as they are then (so weights loaded after ``initialize`` count)."""
        before = int(self.engine.global_steps)
        if not self.outer.started and before >= self.cfg.warmup_steps:
            self._start_rounds()
        out = self._engine_step(*args, **kwargs)
        after = int(self.engine.global_steps)
        if after != before:
            self._after_step(after)
        return out

    def _after_step(self, steps: int) -> None:
        warmup, rounds = self.cfg.warmup_steps, self.cfg.local_steps
        if steps <= warmup or not self.outer.started:
            return
        self.reporter.local_step(*self._dense_size())
        if (steps - warmup) % rounds == 0:
            self.sync(steps)

    @torch.no_grad()
    def _start_rounds(self) -> None:
        """θ_outer ← rank 0's master weights, on every rank, and every rank's weights ← θ_outer: the rounds start
        from the same weights however the ranks got here."""
        masters = self.masters()
        if copy_rank0_(masters, self.pipeline(self.group).backend):
            self._masters_to_model()
        self.outer.start(masters)

    def _dense_size(self) -> tuple:
        numel = sum(p.numel() for p in self.engine.module.parameters() if p.requires_grad)
        world = self.pipeline(self.group).backend.world_size
        return numel, self.engine.communication_data_type.itemsize, world

    @torch.no_grad()
    def sync(self, steps: int) -> None:
        """The outer step (module docstring), collective over the data-parallel group."""
        masters = self.masters()
        pipeline = self.pipeline(self.group)
        world = pipeline.backend.world_size
        dtype = self.engine.communication_data_type
        clock = PhaseClock(masters[0].device)
        deltas = self.outer.pseudo_gradient(masters)
        numel = sum(d.numel() for d in deltas)
        key = BucketKey(OUTER, 0, str(dtype), numel, shapes_digest(masters))
        device = masters[0].device
        # this round started from θ_outer − residual: Δ counts only this round's progress
        subtract_(deltas, kept_in_weights(pipeline, key, numel, device, self.topology) if self.held else None)
        stats = None
        if self.cfg.density >= 1.0:
            out = pipeline.reduce_dense(deltas, key, 1.0, 1.0 / world, dtype)
            sent = self.topology.outer_dense_bytes(numel, dtype.itemsize, world)
        else:
            self.compressor.density = self.cfg.density
            out, stats = pipeline.reduce(deltas, key, bucket_seed(SEED, steps, 0), 1.0, 1.0 / world, dtype,
                                         age_step=(steps - self.cfg.warmup_steps) // self.cfg.local_steps)
            sent = stats.bytes_sent
        self.outer.apply_(segment_views(out, deltas))
        self.outer.restart_(masters)
        holds = holds_in_weights(self.cfg, self.error_feedback.enabled)
        kept = kept_in_weights(pipeline, key, numel, device, self.topology) if holds else None
        subtract_(masters, kept)  # the unsent Δ stays in this rank's weights (error reset, CSER)
        self.held = kept is not None
        self._masters_to_model()
        self.reporter.outer(steps, numel, sent, stats, clock.lap())

    @torch.no_grad()
    def before_disable(self) -> None:
        """Collective: between syncs each rank holds its own weights (its unsent Δ) and optimizer state; all take
        rank 0's (as a restart from its checkpoint would), so the dense steps that follow start from one state."""
        if self.outer.started:
            masters = self.masters()
            state = [t for m in masters for t in self.optimizer.state.get(m, {}).values()
                     if torch.is_tensor(t) and t.is_floating_point()]
            if copy_rank0_(masters + state, self.pipeline(self.group).backend):
                self._masters_to_model()

    # -- state (engine/state.py) -------------------------------------------------------------------
    def extra_state(self) -> dict:
        """θ_outer and the outer velocity (``outer``), and this rank's replica (``local_resume.replica_state``)."""
        return {"outer": self.outer.state_dict(), "replica": replica_state(self), "held": self.held}

    @torch.no_grad()
    def load_extra_state(self, saved: dict) -> None:
        """Restore this rank's replica over what DeepSpeed loaded (rank 0's), then θ_outer.

        Raises:
            ValueError: the saved replica or θ_outer does not match this engine's master weights.
        """
        masters = self.masters()
        if saved.get("replica") is not None:
            load_replica(self, saved["replica"])
        outer = saved.get("outer")
        if outer is not None:  # (none saved, or saved in the warm-up: the next step starts the rounds)
            self.outer.load_state_dict(outer, masters)
        self.held = bool(saved.get("held", False))

    def reset_extra_state(self) -> None:
        """No θ_outer: the next step starts the rounds from rank 0's weights as they are then."""
        self.outer = OuterStep(self.outer_lr)
        self.held = False

    def restore_after_reset(self, saved: dict, reasons: List[str]) -> None:
        """Saved at another world size or node layout (or by another rank): keep θ_outer and the round count
        (``local_resume.keep_outer``)."""
        self._moved = keep_outer(self, saved, reasons)

    def after_load(self, saved_worlds: List[Optional[int]]) -> None:
        """A checkpoint of another world size or node layout: every rank restarts from rank 0's θ_outer
        (``local_resume.restart_from_outer``)."""
        moved, self._moved = self._moved, None
        restart_from_outer(self, saved_worlds, moved)
        dense_again(self)


def _check_optimizer(engine: Any, optimizer: Any, masters: Any) -> None:
    """Refuse an engine without a torch optimizer and its fp32 master weights inside."""
    wrapper = getattr(engine, "optimizer", None)  # (DeepSpeed's BF16_Optimizer: a row of plan.RULES)
    if optimizer is None or not masters():
        raise LocalStepsUnsupported(f"'dragonn.sync': 'local_steps' needs a torch optimizer inside the engine; "
                                    f"found {type(wrapper).__name__}")


def check_local_steps_hook_point(engine_cls: Optional[type] = None) -> None:
    """Fail loudly if a DeepSpeed upgrade renamed what :class:`LocalStepsHook` replaces on the engine
    (``allreduce_gradients``, turned off between syncs; ``step``) or the step it counts rounds by."""
    from .probes import require_methods
    if engine_cls is None:
        from deepspeed.runtime.engine import DeepSpeedEngine as engine_cls
    require_methods(engine_cls, {"allreduce_gradients": (), "step": ("lr_kwargs",),
                                 "_take_model_step": ("lr_kwargs",), "_backward_epilogue": ()},
                    "'sync': 'local_steps' could not stop the per-step exchange")


__all__ = ["LocalStepsHook", "LocalStepsUnsupported", "check_local_steps_hook_point"]
