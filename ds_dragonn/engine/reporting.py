"""What a hook tells the user: the start-up line, the switch to compression, the auto policy's decisions,
periodic reduction logs (rank 0, DeepSpeed's ``print_dist``) and DeepSpeed monitor events
(TensorBoard / W&B / CSV, ``engine.monitor``), from the running :class:`~ds_dragonn.telemetry.Telemetry`.
"""
from __future__ import annotations

from typing import Any, Optional

from deepspeed.utils.logging import print_dist

from .. import constants
from ..config import DragonnConfig, Policy
from ..pipeline import ReduceStats, request_timing
from ..schedule import DensitySchedule
from ..telemetry import Telemetry, log_reduction, monitor_events


class Reporter:
    """Logs and monitor events of one hook.

    Args:
        engine: the DeepSpeed engine (its ``monitor``, ``global_samples`` and ``train_batch_size()``).
        cfg: the validated ``"dragonn"`` block.
        schedule: the hook's density schedule (described in the logs).
    """

    def __init__(self, engine: Any, cfg: DragonnConfig, schedule: DensitySchedule):
        self.engine = engine
        self.cfg = cfg
        self.schedule = schedule
        self.telemetry = Telemetry()
        self._announced = False  # the switch to compression was logged
        request_timing(cfg.log_interval == 1)  # the first compressed reduction is logged: time it

    def start(self, hook_name: str, compressor_name: str, exchange: str) -> None:
        """The start-up line: every setting that shapes the run."""
        cfg = self.cfg
        probe = (f" (probe {constants.AUTO_PROBE_STEPS} steps, re-check every {constants.AUTO_RECHECK_INTERVAL})"
                 if cfg.policy == Policy.auto else "")
        print_dist(f"DRAGONN enabled ({hook_name}): compressor={compressor_name} density={cfg.density} "
                   f"kernel={getattr(cfg.kernel, 'value', cfg.kernel)} "
                   f"min_compress_numel={cfg.min_compress_numel} "
                   f"schedule: {self.schedule.describe()}; "
                   f"values={getattr(cfg.values, 'value', cfg.values)} "
                   f"error_feedback={cfg.error_feedback} comm_backend={cfg.comm_backend.value} "
                   f"exchange={exchange} policy={cfg.policy.value}{probe}", ranks=[0])

    def announce(self, step: int) -> None:
        """The first compressed reduction (once)."""
        if self._announced:
            return
        self._announced = True
        if self.cfg.policy == Policy.auto:
            print_dist(f"DRAGONN auto: compressing from step {step + 1} (schedule: {self.schedule.describe()}); "
                       f"the compressed path is timed at the target density and the decision follows after "
                       f"{constants.AUTO_PROBE_STEPS} such steps", ranks=[0])
        else:
            print_dist(f"DRAGONN: compressing from step {step + 1}; schedule: {self.schedule.describe()}",
                       ranks=[0])

    def dense(self, numel: int, itemsize: int, world: int, ms: float, dense_bytes: Optional[int] = None,
              quantized_bytes: Optional[int] = None) -> None:
        """A dense reduction of ``numel`` elements of ``itemsize`` bytes took ``ms`` (``quantized_bytes``: sent
        quantized, ``advanced.dense_values``)."""
        self.telemetry.record_dense(numel, itemsize, world, ms, dense_bytes, quantized_bytes)
        self._monitor(None, ms)

    def compressed(self, stats: ReduceStats, step: int) -> None:
        """A compressed reduction (logged every ``log_interval`` compressed reductions)."""
        self.telemetry.record_compressed(stats)
        if self.cfg.log_interval and self.telemetry.compressed_reductions % self.cfg.log_interval == 0:
            # 1-based like DeepSpeed's own step logs (global_steps is incremented after engine.step())
            log_reduction(step + 1, stats)
        self._monitor(stats)
        # time (device-synchronised) only the next reduction that will be logged
        every = self.cfg.log_interval
        request_timing(bool(every) and (self.telemetry.compressed_reductions + 1) % every == 0)

    def local_step(self, numel: int, itemsize: int, world: int) -> None:
        """``sync: local_steps``: an optimizer step that exchanged nothing (counted against dense training)."""
        self.telemetry.record_local(numel, itemsize, world)

    def node_average(self, bytes_sent: int, ms: float) -> None:
        """``sync: local_steps``, node-aware: a local step's gradient average inside the node."""
        self.telemetry.record_node(bytes_sent, ms)

    def outer(self, step: int, numel: int, bytes_sent: int, stats: Optional[ReduceStats], ms: float) -> None:
        """``sync: local_steps``: an outer step of ``numel`` weights (logged every ``log_interval`` outer steps, and
        the first)."""
        t = self.telemetry
        t.record_outer(bytes_sent, stats)
        if t.outer_syncs == 1 or (self.cfg.log_interval and t.outer_syncs % self.cfg.log_interval == 0):
            kept = f"kept={stats.kept} k={stats.k}" if stats is not None else "dense allreduce"
            print_dist(f"DRAGONN outer step {t.outer_syncs} at step={step}: numel={numel} {kept} bytes={bytes_sent} ms={ms:.1f}; run so far: bytes_ratio={t.bytes_ratio:.5f} "
                       f"of dense data-parallel training ({t.local_steps_taken} local steps)", ranks=[0])
        self._monitor(stats, None if stats is not None else ms)

    def decided(self, ordinal: int, numel: int, decision: tuple) -> None:
        """The auto policy's agreed ``(compress?, dense ms, compressed ms)`` for bucket ``ordinal``."""
        compress, dense_ms, comp_ms = decision
        recheck = (f" (re-check in {constants.AUTO_RECHECK_INTERVAL} steps)" if constants.AUTO_RECHECK_INTERVAL
                   else "")
        print_dist(f"DRAGONN auto: bucket {ordinal} ({numel} elements) dense {dense_ms:.2f} ms, compressed "
                   f"{comp_ms:.2f} ms -> {'compress' if compress else 'dense'}{recheck}", ranks=[0])

    def _monitor(self, stats: Optional[ReduceStats], dense_ms: Optional[float] = None) -> None:
        monitor = getattr(self.engine, "monitor", None)
        if monitor is None or not getattr(monitor, "enabled", False):
            return
        # DeepSpeed's x-axis: the global samples its Train/Samples/* events of this step will carry
        samples = int(getattr(self.engine, "global_samples", 0)) + int(self.engine.train_batch_size())
        monitor.write_events(monitor_events(self.telemetry, samples, stats, dense_ms))


__all__ = ["Reporter"]
