"""The DRAGONN compressor: sampled threshold + hashed index table (Wang et al., ICML 2022, Sec. 3).

The maths lives in ``reference`` (the pure-PyTorch definition, re-exported here), the fast
implementations in ``kernels``; this class picks one per buffer and fixes the parameters (density,
sample size, table capacity, per-call seeds). See ``reference`` for the algorithm.
"""
from __future__ import annotations

import math

import torch

from .. import constants
from .base import Compressor, Selection, index_dtype, max_pairs, segment_seed, target_k, trim
from .chunks import chunk_lengths, chunk_offsets, chunk_rank
from .kernels import check_kernel, cpu_table, resolve_kernel, sample_kth_fast, sample_threshold_fast, select_fast
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
        chunk: None (one threshold over the buffer), or chunk-wise selection with chunks of this many entries
            (``compress/chunks.py``; SparseLoCo's chunk-wise top-k, Sarfi et al. 2025): per chunk a threshold
            from ``CHUNK_SAMPLE`` sampled magnitudes and its own table, at most ``k_c`` pairs kept.
    """

    name = "dragonn"
    #: a buffer with NaN/±Inf always sends at least one of them (they rank first): the pipeline may skip
    #: its full non-finite pass when every sent value is finite (chunk-wise: see ``sends_non_finite``)
    finite_proof = True

    def __init__(self, density: float, sample_ratio: float = 0.001, min_sample: int = 1024,
                 table_factor: float = 4.0, kernel: str = "auto", chunk: int | None = None):
        super().__init__(density, chunk)
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

    def chunk_plan(self, layout, ks: torch.Tensor) -> tuple:
        """(offsets (nchunks+1,) int64, plan (4, nchunks) int64) of a chunk-wise selection: per chunk the sample
        size (``CHUNK_SAMPLE``; 0 where ``k_c ≥`` its length: threshold 0), the threshold's rank in the sample
        (``chunks.chunk_rank``), the table slots ``min(ceil(table_factor · k_c), length)`` and the cap ``k_c``."""
        lens = chunk_lengths(layout)
        s = torch.where((ks > 0) & (ks < lens), lens.clamp(max=constants.CHUNK_SAMPLE), 0)
        m = torch.where(ks > 0, torch.minimum(torch.ceil(ks.double() * self.table_factor).long(), lens), 0)
        rank = torch.zeros_like(ks)
        last = len(ks) - 1  # every chunk before the last holds `chunk` entries: their k_c take one or two values
        for part in (slice(0, last), slice(last, last + 1)):
            if part.stop > part.start:
                n = int(lens[part.start])
                values, inverse = torch.unique(ks[part], return_inverse=True)
                ranks = [chunk_rank(min(constants.CHUNK_SAMPLE, n), k, n, constants.CHUNK_MISS) if 0 < k < n else 0
                         for k in values.tolist()]
                rank[part] = torch.tensor(ranks, dtype=torch.int64)[inverse]
        return chunk_offsets(layout), torch.stack([s, rank, m, ks]).contiguous()

    def _select_chunks(self, flat: torch.Tensor, layout, ks: torch.Tensor, seed: int) -> Selection:
        offsets, plan = self.chunk_plan(layout, ks)
        n, k = flat.numel(), int(ks.sum())
        if resolve_kernel(self.kernel, flat) == "cpu":
            idx, vals, thr = cpu_table.select_segments(flat, offsets, plan, seed, index_dtype(n))
        else:
            idx, vals, thr = self._run_plan(flat, layout.offsets, plan, seed)
        used = plan[2] > 0
        thr = thr[used].min() if bool(used.any()) else torch.zeros((), dtype=torch.float32)
        return Selection(indices=idx, values=vals, threshold=thr.to(flat.device), k=k, capacity=k)

    def _run_plan(self, flat: torch.Tensor, offsets, plan: torch.Tensor, seed: int) -> tuple:
        """The definition of a planned selection (``cpu_table.select_segments``' contract) on any kernel: per
        segment ``s`` the ``plan[1, s]``-th largest of ``plan[0, s]`` sampled magnitudes, a table of ``plan[2, s]``
        slots, cut to ``plan[3, s]`` pairs (:func:`trim`), with :func:`segment_seed`. Returns (indices, values,
        thresholds (nseg,) float32 on the CPU)."""
        kernel, n = resolve_kernel(self.kernel, flat), flat.numel()
        rows = plan.tolist()
        idx, vals, thr = [], [], torch.zeros(len(rows[0]), dtype=torch.float32)
        for c, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            ns, kk, m, cap = (row[c] for row in rows)
            if hi <= lo or m <= 0:
                continue
            part, sd = flat[lo:hi], segment_seed(seed, c)
            t = (sample_kth_fast(part, ns, kk, step_sample_seed(sd), kernel) if ns > 0
                 else torch.zeros((), dtype=torch.float32, device=flat.device))
            sel = Selection(*select_fast(part, t, m, step_hash_seed(sd), kernel), t, cap, m)
            sel = trim(sel, cap) if cap > 0 else sel
            idx.append(sel.indices.to(index_dtype(n)) + lo)
            vals.append(sel.values)
            thr[c] = float(t)
        return (torch.cat(idx) if idx else flat.new_empty(0, dtype=index_dtype(n)),
                torch.cat(vals) if vals else flat.new_empty(0), thr)

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
