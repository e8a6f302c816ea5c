"""DRAGONN selection, the pure-PyTorch definition (Wang et al., ICML 2022, Sec. 3).

The kernels (``kernels/``) reproduce these functions bit for bit; ``dragonn.DragonnCompressor`` drives them.
Per buffer: :func:`sample_threshold` (stratified hashed sample, :func:`sample_positions`), :func:`build_table`
(hashed table of :func:`priority_keys`, a collision keeps the largest key; direct when m ≥ n), :func:`gather_table`.
Non-finite entries count as infinitely large. See docs/design.md, 'The data path of one bucket', and
docs/kernels.md.
"""
from __future__ import annotations

import math

import torch

from .base import EMPTY_SLOT, index_dtype, magnitude, target_k
from .hashing import murmur3_index_hash


#: The sample always holds at least this many expected above-threshold hits (docs/kernels.md).
MIN_SAMPLE_HITS = 256


def sample_size(numel: int, sample_ratio: float, min_sample: int, density: float = 1.0) -> int:
    """Threshold sample size ``s = min(n, max(min_sample, ceil(sample_ratio·n), ceil(256/density)))``."""
    need = MIN_SAMPLE_HITS / density  # inf for densities below ~1e-306: then the whole buffer
    if not need < numel:
        return numel
    return min(numel, max(min_sample, math.ceil(sample_ratio * numel), math.ceil(need)))


def candidate_density(density: float, table_factor: float, direct: bool = False) -> float:
    """Fraction of the buffer the threshold should pass so that about ``k`` pairs survive the table.

    ``c`` candidates in ``m = table_factor·k`` slots occupy ``m·(1 − exp(−c/m))`` of them, so
    ``c = −table_factor·ln(1 − 1/table_factor)·k`` keep ``k`` in expectation (docs/kernels.md); capped at
    ``table_factor``. A direct table (``direct``: m ≥ n) needs no correction.
    """
    if direct or table_factor <= 1.0:
        return density
    boost = min(-table_factor * math.log1p(-1.0 / table_factor), table_factor)
    return min(1.0, density * boost)


def table_capacity(k: int, table_factor: float, numel: int | None = None) -> int:
    """Hash-table slots ``m = min(ceil(table_factor * k), numel)`` (0 when k == 0).
    """
    if k <= 0:
        return 0
    m = math.ceil(table_factor * k)
    return m if numel is None else min(m, numel)


def step_hash_seed(seed: int) -> int:
    """32-bit hash seed derived from a call seed (decorrelated from the sampling generator's seed)."""
    return (int(seed) * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF


def step_sample_seed(seed: int) -> int:
    """32-bit seed of the threshold sample positions, decorrelated from :func:`step_hash_seed`."""
    return (int(seed) * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF


def sample_positions(numel: int, num_samples: int, seed: int, device=None) -> torch.Tensor:
    """Stratified hashed sample: position ``j`` is drawn from stratum ``[j·n//s, (j+1)·n//s)``.

    ``pos_j = start_j + murmur3(j, seed) mod (end_j − start_j)``, ``start_j = j·q + (j·r)//s``, ``q, r = divmod(n, s)``;
    positions ascend. The CPU and Triton kernels compute the same positions.

    Args:
        numel: n ≥ 1. num_samples: s in [1, n]. seed: 32-bit seed (see :func:`step_sample_seed`).
    Returns:
        (s,) int64 positions in [0, n), strictly increasing.
    """
    q, r = divmod(int(numel), int(num_samples))
    j = torch.arange(num_samples + 1, dtype=torch.int64, device=device)
    bounds = j * q + (j * r) // num_samples
    start, length = bounds[:-1], bounds[1:] - bounds[:-1]
    return start + murmur3_index_hash(j[:-1], seed) % length


def sample_threshold(flat: torch.Tensor, density: float, num_samples: int,
                     generator: torch.Generator | None = None, *, seed: int | None = None) -> torch.Tensor:
    """Estimate the top-k magnitude threshold from a random sample.

    Args:
        flat: (n,) float tensor, n ≥ 1.
        density: fraction kept, in (0, 1].
        num_samples: s in [1, n]; s == n uses every element (exact threshold, no randomness).
        generator: private generator on ``flat.device``: s positions uniform with replacement.
        seed: instead of ``generator``: the stratified hashed sample of :func:`sample_positions`
            (what the compressor and its kernels use).
    Returns:
        0-d float32 tensor on ``flat.device``: the ``ceil(density * s)``-th largest finite |sample|.
    """
    n = flat.numel()
    if num_samples >= n:
        sample = flat
    elif seed is not None:
        sample = flat[sample_positions(n, num_samples, seed, flat.device)]
    else:
        pos = torch.randint(0, n, (num_samples,), generator=generator, device=flat.device)
        sample = flat[pos]
    return _kth_finite(sample, target_k(sample.numel(), density))


def sample_kth(flat: torch.Tensor, num_samples: int, kk: int, seed: int) -> torch.Tensor:
    """The ``kk``-th largest finite magnitude of the :func:`sample_positions` sample: :func:`sample_threshold`
    with the rank given directly (chunk-wise selection, ``chunks.chunk_rank``).

    Args:
        flat: (n,) float tensor, n ≥ 1. num_samples: s ≥ 1. kk: rank in [1, min(s, n)]. seed: 32-bit seed.
    Returns:
        0-d float32 tensor on ``flat.device``.
    """
    n = flat.numel()
    sample = flat if num_samples >= n else flat[sample_positions(n, num_samples, seed, flat.device)]
    return _kth_finite(sample, kk)


def _kth_finite(sample: torch.Tensor, kk: int) -> torch.Tensor:
    mag = sample.abs().float()
    mag = torch.where(torch.isfinite(mag), mag, torch.zeros((), device=mag.device))
    return torch.topk(mag, kk, sorted=False).values.min()


def selection_mask(flat: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """(n,) bool: ``|g| >= threshold`` and ``g != 0``; NaN/±Inf always True."""
    mag = magnitude(flat)
    return (mag >= threshold) & (mag > 0)


def hash_slots(indices: torch.Tensor, seed: int, capacity: int) -> torch.Tensor:
    """Table slot of each index: ``murmur3_x86_32(index, seed) mod capacity`` (int64)."""
    return murmur3_index_hash(indices, seed) % capacity


def index_bits(numel: int) -> int:
    """Bits reserved for the index in a priority key: 32, or more for buffers of 2^32+ elements."""
    return max(32, (max(numel, 1) - 1).bit_length())


def priority_keys(mag: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """int64 collision-priority keys ``(magnitude bits >> shift) << b | index`` (all ≥ 0).

    Args:
        mag: (c,) float32 magnitudes (≥ 0, +Inf allowed) of the candidates.
        indices: (c,) int64 candidate positions.
        numel: buffer length; ``b = index_bits(numel)`` and ``shift = b - 32`` keep the key in 63 bits.
    Returns:
        (c,) int64; the larger key has the larger magnitude (ties: larger index).
    """
    b = index_bits(numel)
    mbits = mag.float().view(torch.int32).to(torch.int64) >> (b - 32)  # non-negative float: bits order = value order
    return (mbits << b) | indices


def key_to_index(keys: torch.Tensor, numel: int) -> torch.Tensor:
    """Index part of :func:`priority_keys` (int64)."""
    return keys & ((1 << index_bits(numel)) - 1)


def build_table(flat: torch.Tensor, threshold: torch.Tensor, capacity: int, seed: int) -> torch.Tensor:
    """The hashed table of priority keys (reference implementation).

    Args:
        flat: (n,) float tensor.
        threshold: 0-d float32 tensor (on the device).
        capacity: m ≥ 1 slots; m ≥ n switches to direct indexing (slot = index).
        seed: 32-bit hash seed.
    Returns:
        (m,) int64 table: per slot the largest :func:`priority_keys` key that hashed there, or
        ``EMPTY_SLOT`` (-1) where none did. :func:`gather_table` turns it into indices.
    """
    n = flat.numel()
    mag = magnitude(flat)
    idx = torch.nonzero((mag >= threshold) & (mag > 0)).squeeze(1)
    keys = priority_keys(mag[idx], idx, n)
    table = torch.full((capacity,), EMPTY_SLOT, dtype=torch.int64, device=flat.device)
    slots = idx if capacity >= n else hash_slots(idx, seed, capacity)
    return table.scatter_reduce_(0, slots, keys, reduce="amax", include_self=True)


def gather_table(flat: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid slots of ``table`` → (indices (c,) int32/int64 by buffer size, values (c,) flat.dtype)."""
    n = flat.numel()
    idx = key_to_index(table[table != EMPTY_SLOT], n)
    return idx.to(index_dtype(n)), flat[idx]
