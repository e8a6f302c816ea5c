"""Per bucket and step: dense or compressed, and at which density.

Every rank must take the same branch, or the collectives would not match: the decision depends only on
the step, the bucket's size and dtype, the world size, the config and the auto policy's agreed state.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, NamedTuple, Optional

import torch
from deepspeed.utils.logging import print_dist

from ..compress import max_pairs, target_k
from ..compress.age_bound import block_capacity
from ..compress.base import Compressor
from ..config import DragonnConfig, Policy
from ..constants import AUTO_PROBE_STEPS, AUTO_RECHECK_INTERVAL
from ..pipeline import CompressedAllreduce
from ..policy import AutoPolicy
from ..plan import density_schedule


class Choice(NamedTuple):
    """What :meth:`BucketDecision.choose` decided for one bucket.

    Attributes:
        dense: reduce with the dense collective this step.
        fixed: the reason does not depend on timings (the auto policy does not time this reduction).
    """
    dense: bool
    fixed: bool


class BucketDecision:
    """The dense-or-compressed decision (``min_compress_numel``, warm-up, bytes, the auto policy) and the
    density schedule of each bucket.

    Args:
        cfg: the validated ``"dragonn"`` block.
    """

    def __init__(self, cfg: DragonnConfig):
        self.cfg = cfg
        self.policy = AutoPolicy(AUTO_PROBE_STEPS, AUTO_RECHECK_INTERVAL, always=cfg.policy == Policy.always)
        self.schedule = density_schedule(cfg)
        self._warned_small = False
        self._costly: Dict[Hashable, bool] = {}  # bucket key -> its pairs may cost more than dense

    def choose(self, key: Hashable, numel: int, step: int, pipeline: CompressedAllreduce, dtype: torch.dtype,
               dense_bytes: Optional[int] = None) -> Choice:
        """Dense: below ``min_compress_numel``, in the warm-up, pairs that would cost more bytes than the
        dense collective (``dense_bytes``, default the pipeline's; policy ``auto``), or the auto policy's
        timing choice."""
        small = numel < max(self.cfg.min_compress_numel, 1)
        if small and not self._warned_small:
            self._warned_small = True
            print_dist(f"DRAGONN: a gradient bucket of {numel} elements is below min_compress_numel="
                       f"{self.cfg.min_compress_numel}: it uses DeepSpeed's dense path (lower "
                       f"'dragonn.min_compress_numel' to compress it)", ranks=[0])
        costly = not small and self._pairs_cost_more(key, numel, pipeline, dtype, dense_bytes)
        warm = self.schedule.dense(step)
        fixed = small or (costly and self.cfg.policy == Policy.auto)
        return Choice(fixed or warm or not self.policy.compress(key), fixed)

    def _pairs_cost_more(self, key: Hashable, numel: int, pipeline: CompressedAllreduce, dtype: torch.dtype,
                         dense_bytes: Optional[int]) -> bool:
        """Whether this rank's pairs may cost more bytes than the dense collective (at most ``max_pairs(k)`` pairs
        through the exchange). Decided once per bucket and logged on rank 0."""
        hit = self._costly.get(key)
        if hit is None:
            world = pipeline.backend.world_size
            pairs = max_pairs(target_k(numel, self.cfg.density))  # the target density: its warm-up is transient
            pairs += block_capacity(numel, self.cfg.max_age)  # the age bound's block, counted as pairs (an upper bound)
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

    def set_density(self, compressor: Compressor, step: int) -> None:
        """The compressor's density for this step (the density warm-up); the same on every rank."""
        d = self.schedule.at(step)
        if d is not None and d != compressor.density:
            compressor.density = d

    def times(self, key: Hashable, step: int, dense: bool) -> bool:
        """Whether the auto policy records the time of this reduction of ``key`` (a ``dense`` one, else a
        compressed one at ``step``): only then is it timed on the device. A compressed one counts only after
        the density warm-up (:meth:`record_compressed`)."""
        if not dense and self.schedule.warming(step):
            return False
        return self.policy.probing(key, dense)

    def record_dense(self, key: Hashable, ms: float, fixed: bool) -> None:
        """A dense reduction of ``key`` took ``ms`` (timed by the auto policy unless ``fixed``)."""
        if not fixed:
            self.policy.record_dense(key, ms)

    def record_compressed(self, key: Hashable, step: int, ms: float, backend: Any, device: torch.device):
        """A compressed reduction of ``key`` took ``ms``. Returns ``(compress?, dense ms, compressed ms)`` when
        the auto policy decided for this bucket at this call (an agreed decision), else None. The policy
        times the compressed path at its target density only, after the density warm-up."""
        if not self.schedule.warming(step) and self.policy.record_compressed(key, ms):
            return self.policy.decide(key, backend, device)
        return None


__all__ = ["BucketDecision", "Choice"]
