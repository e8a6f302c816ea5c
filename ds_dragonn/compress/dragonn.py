"""The DRAGONN compressor: sampled threshold + hashed index table (Wang et al., ICML 2022, Sec. 3).

The maths lives in ``reference`` (the pure-PyTorch definition, re-exported here), the fast
implementations in ``kernels``; this class picks one per buffer and fixes the parameters (density,
sample size, table capacity, per-call seeds). See ``reference`` for the algorithm.
"""
from __future__ import annotations

import math

import torch

from .base import Compressor, Selection, index_dtype, max_pairs, target_k, whole_tail
from .kernels import check_kernel, cpu_table, resolve_kernel, sample_threshold_fast, select_fast
from .reference import (  # noqa: F401  (re-exported: the reference API)
    MIN_SAMPLE_HITS, build_table, candidate_density, gather_table, hash_slots, index_bits, key_to_index,
    priority_keys, sample_positions, sample_size, sample_threshold, selection_mask, step_hash_seed,
    step_sample_seed, table_capacity)


class DragonnCompressor(Compressor):
    """DRAGONN hash-sampled selection (see module docstring).

    Args:
        density: fraction kept, in (0, 1].
        sample_ratio: fraction of the buffer sampled for the threshold.
        min_sample: lower bound on the sample size.
        table_factor: table slots per target element (paper: 4).
        kernel: ``auto`` (Triton on CUDA, the C++ library on CPU, else the reference), ``reference``
            (pure PyTorch), ``cpu`` or ``triton``. All give identical selections for the same seed.
    """

    name = "dragonn"
    #: a buffer with NaN/±Inf always sends at least one of them (they rank first): the pipeline may skip
    #: its full non-finite pass when every sent value is finite
    sends_non_finite = True

    def __init__(self, density: float, sample_ratio: float = 0.001, min_sample: int = 1024,
                 table_factor: float = 4.0, kernel: str = "auto"):
        super().__init__(density)
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio}")
        if min_sample < 1:
            raise ValueError(f"min_sample must be >= 1, got {min_sample}")
        if not (1.0 <= table_factor and math.isfinite(table_factor)):
            raise ValueError(f"table_factor must be finite and >= 1, got {table_factor}")
        self.sample_ratio = float(sample_ratio)
        self.min_sample = int(min_sample)
        self.table_factor = float(table_factor)
        self.kernel = check_kernel(getattr(kernel, "value", kernel))
        self._plans: dict = {}  # (segments, density) -> the CPU kernel's per-segment plan

    def segment_plan(self, segments, ks) -> tuple:
        """(offsets (nseg+1,) int64, plan (3, nseg) int64, capacity) of a per-tensor selection: per segment the
        threshold sample size (0: threshold 0), the threshold's rank in the sample and the table slots, as
        :meth:`threshold` and :meth:`_select` would use on the segment alone. Cached per (segments, density)."""
        key = (segments, self.density)
        hit = self._plans.get(key)
        if hit is None:
            rows, cap = [], 0
            for n, k, whole in zip(segments.lengths(), ks, segments.whole):
                if k == 0 or whole:  # whole segments: appended after the call (base.whole_tail)
                    rows.append((0, 0, 0))
                    continue
                m = table_capacity(k, self.table_factor, n)
                cap += min(m, max_pairs(k))
                if k >= n:
                    rows.append((0, 0, m))
                    continue
                s = sample_size(n, self.sample_ratio, self.min_sample, self.density)
                rate = candidate_density(self.density, self.table_factor, direct=m >= n)
                rows.append((s, target_k(s, rate), m))
            plan = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).t().contiguous()
            if len(self._plans) > 64:  # a density warm-up visits a new density every step
                self._plans.clear()
            hit = self._plans[key] = (torch.tensor(segments.offsets, dtype=torch.int64), plan, cap)
        return hit

    def _select_segments(self, flat: torch.Tensor, segments, ks, seed: int) -> Selection:
        if resolve_kernel(self.kernel, flat) != "cpu":
            return super()._select_segments(flat, segments, ks, seed)
        offsets, plan, cap = self.segment_plan(segments, ks)
        idx, vals, thr = cpu_table.select_segments(flat, offsets, plan, seed, index_dtype(flat.numel()))
        used = plan[2] > 0
        thr = thr[used].min() if bool(used.any()) else torch.zeros((), dtype=torch.float32)
        return whole_tail(Selection(indices=idx, values=vals, threshold=thr, k=sum(ks), capacity=cap), flat, segments)

    def threshold(self, flat: torch.Tensor, seed: int, kernel: str = "reference", k: int | None = None) -> torch.Tensor:
        """0-d float32 threshold of ``flat`` for target ``k`` (default ``ceil(density · n)``; 0 when k ≥ n)."""
        n = flat.numel()
        k = target_k(n, self.density) if k is None else k
        if k >= n:
            return torch.zeros((), dtype=torch.float32, device=flat.device)  # keep every nonzero
        s = sample_size(n, self.sample_ratio, self.min_sample, self.density)
        rate = candidate_density(self.density, self.table_factor,
                                 direct=table_capacity(k, self.table_factor, n) >= n)
        return sample_threshold_fast(flat, rate, s, step_sample_seed(seed), kernel)

    def _select(self, flat: torch.Tensor, k: int, seed: int) -> Selection:
        n = flat.numel()
        kernel = resolve_kernel(self.kernel, flat)
        m = table_capacity(k, self.table_factor, n)
        thr = self.threshold(flat, seed, kernel, k)
        idx, vals = select_fast(flat, thr, m, step_hash_seed(seed), kernel)
        return Selection(indices=idx, values=vals, threshold=thr, k=k, capacity=min(m, max_pairs(k)))
