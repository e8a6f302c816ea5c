"""The ``"auto"`` compression decision: compress a bucket only where it is faster than the dense allreduce.

Per bucket, on the real link (cf. PowerSGD's ``min_compression_rate``, which decides from sizes alone): probe
dense, probe compressed, then the ranks sum their medians with one small allreduce and every rank takes the same
decision; re-checked after ``recheck_interval`` reductions. The state advances only with the count of reductions
of the bucket, so ranks never disagree on the phase. See docs/design.md, 'The auto policy'.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, Hashable, List

import torch

from .comm.base import CommBackend


class Phase(str, Enum):
    probe_dense = "probe_dense"
    probe_compressed = "probe_compressed"
    decided = "decided"


@dataclass
class BucketPolicy:
    """Decision state of one bucket."""
    phase: Phase = Phase.probe_dense
    dense_ms: List[float] = field(default_factory=list)
    compressed_ms: List[float] = field(default_factory=list)
    compress: bool = True  # the decision (meaningful once decided)
    since: int = 0  # reductions of this bucket since the decision
    decisions: int = 0


class AutoPolicy:
    """Per-bucket compress/dense decisions from measured times (see module docstring).

    Args:
        probe_steps: timed reductions of each kind before a decision (≥ 1).
        recheck_interval: reductions of a bucket between decisions (0: decide once).
        always: when True, every bucket is compressed and nothing is measured (``"policy": "always"``).
    """

    def __init__(self, probe_steps: int = 3, recheck_interval: int = 1000, always: bool = False):
        if probe_steps < 1:
            raise ValueError(f"probe_steps must be >= 1, got {probe_steps}")
        self.probe_steps = int(probe_steps)
        self.recheck_interval = int(recheck_interval)
        self.always = bool(always)
        self.buckets: Dict[Hashable, BucketPolicy] = {}

    def _state(self, key: Hashable) -> BucketPolicy:
        return self.buckets.setdefault(key, BucketPolicy())

    def compress(self, key: Hashable) -> bool:
        """Whether the next reduction of ``key`` goes through the compressed path."""
        if self.always:
            return True
        st = self._state(key)
        if st.phase is Phase.decided:
            return st.compress
        return st.phase is Phase.probe_compressed

    def probing(self, key: Hashable, dense: bool) -> bool:
        """Whether the next ``dense`` (else compressed) reduction of ``key`` is one of the timed probes: its
        phases must then be timed on the device (``pipeline.PhaseClock``), which syncs a CUDA device."""
        if self.always:
            return False
        phase = self._state(key).phase
        return phase is (Phase.probe_dense if dense else Phase.probe_compressed)

    def record_dense(self, key: Hashable, ms: float) -> None:
        """A dense reduction of ``key`` took ``ms`` (warm-up reductions count as probes)."""
        if self.always:
            return
        st = self._state(key)
        if st.phase is Phase.probe_dense:
            st.dense_ms.append(ms)
            if len(st.dense_ms) >= self.probe_steps:
                st.phase = Phase.probe_compressed
        elif st.phase is Phase.decided:
            self._tick(st)

    def record_compressed(self, key: Hashable, ms: float) -> bool:
        """A compressed reduction of ``key`` took ``ms``; True when a decision is now due (:meth:`decide`)."""
        if self.always:
            return False
        st = self._state(key)
        if st.phase is Phase.probe_compressed:
            st.compressed_ms.append(ms)
            return len(st.compressed_ms) >= self.probe_steps
        if st.phase is Phase.decided:
            self._tick(st)
        return False

    def _tick(self, st: BucketPolicy) -> None:
        st.since += 1
        if self.recheck_interval and st.since >= self.recheck_interval:
            st.phase, st.dense_ms, st.compressed_ms, st.since = Phase.probe_dense, [], [], 0

    def decide(self, key: Hashable, backend: CommBackend, device: torch.device) -> tuple[bool, float, float]:
        """Agree with every rank and fix the decision; a collective: every rank calls it at the same reduction.

        Returns:
            (compress, dense_ms, compressed_ms): the decision and the means over ranks of the medians.
        """
        st = self._state(key)
        local = torch.tensor([statistics.median(st.dense_ms), statistics.median(st.compressed_ms)],
                             dtype=torch.float64, device=device)
        backend.all_reduce_sum_(local)
        dense_ms, compressed_ms = (float(v) / backend.world_size for v in local.cpu())
        st.compress = compressed_ms < dense_ms
        st.phase, st.since = Phase.decided, 0
        st.decisions += 1
        return st.compress, dense_ms, compressed_ms
