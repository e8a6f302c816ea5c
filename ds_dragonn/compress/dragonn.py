"""The DRAGONN compressor: sampled threshold + hashed index table (Wang et al., ICML 2022, Sec. 3).

The maths lives in ``reference`` (the pure-PyTorch definition, re-exported here), the fast
implementations in ``kernels``; this class picks one per buffer and fixes the parameters (density,
sample size, table capacity, per-call seeds). See ``reference`` for the algorithm.
"""
from __future__ import annotations

import math

import torch

from .base import Compressor, Selection, max_pairs, target_k
from .kernels import check_kernel, resolve_kernel, sample_threshold_fast, select_fast
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

    def threshold(self, flat: torch.Tensor, seed: int, kernel: str = "reference") -> torch.Tensor:
        n = flat.numel()
        k = target_k(n, self.density)
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
        thr = self.threshold(flat, seed, kernel)
        idx, vals = select_fast(flat, thr, m, step_hash_seed(seed), kernel)
        return Selection(indices=idx, values=vals, threshold=thr, k=k, capacity=min(m, max_pairs(k)))
