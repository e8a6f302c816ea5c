"""Chunk-wise selection: every fixed-size chunk of a bucket sends its own top-k (``advanced.selection: chunked``).

SparseLoCo (Sarfi et al. 2025) cuts the buffer into chunks of 4096 entries and sends the top-k of each, so no part
of the model waits longer than any other. Here each chunk of a :class:`ChunkLayout` gets DRAGONN (Wang et al., ICML
2022) selection of its own: a budget ``k_c`` (:func:`chunk_ks`, ``Σ k_c = k``), a threshold rank
(:func:`chunk_rank`), and a cap of ``k_c`` pairs. See docs/design.md, 'Chunk-wise selection'.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Tuple

import torch

from .budget import target_k


class ChunkLayout(NamedTuple):
    """The chunks of a buffer: chunk ``c`` is ``[offsets[c], offsets[c+1])``.

    Attributes:
        offsets: (nchunks + 1,) ascending element offsets; ``offsets[0] == 0``, ``offsets[-1] == numel``.
    """
    offsets: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.offsets[-1]


@functools.lru_cache(maxsize=64)
def chunk_layout(numel: int, chunk: int) -> ChunkLayout:
    """The chunks of a buffer of ``numel`` ≥ 1 elements: ``[i·chunk, (i+1)·chunk)``, a tail shorter than a chunk
    joined to the last one (so every chunk of a buffer of at least ``chunk`` elements holds ``chunk`` to
    ``2·chunk − 1``); one chunk when ``numel < chunk``. Raises ValueError for ``chunk < 1``."""
    if chunk < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk}")
    count = max(1, numel // chunk)
    offsets = tuple(i * chunk for i in range(count)) + (int(numel),)
    return ChunkLayout(offsets)


@functools.lru_cache(maxsize=64)
def chunk_offsets(layout: ChunkLayout) -> torch.Tensor:
    """(nchunks + 1,) int64 offsets of ``layout``'s chunks (cached: do not modify)."""
    return torch.tensor(layout.offsets, dtype=torch.int64)


def chunk_lengths(layout: ChunkLayout) -> torch.Tensor:
    """(nchunks,) int64 lengths of ``layout``'s chunks."""
    off = chunk_offsets(layout)
    return off[1:] - off[:-1]


def rotation(seed: int, count: int) -> int:
    """First chunk of the budget order of a call with ``seed`` (the same on every rank), in [0, count)."""
    return ((int(seed) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) >> 17) % max(count, 1)


def chunk_ks(layout: ChunkLayout, density: float, seed: int) -> torch.Tensor:
    """Per-chunk targets ``k_c`` (see the module docstring): (nchunks,) int64, ``Σ k_c = target_k(numel)``,
    ``0 ≤ k_c ≤`` the chunk's length."""
    lens = chunk_lengths(layout)
    count, n = lens.numel(), layout.numel
    r = rotation(seed, count)
    rolled = torch.roll(lens, -r)
    ends = torch.cumsum(rolled, 0).double()
    cum = torch.ceil(torch.round(ends * float(density), decimals=9)).long()  # T(x) = ceil(density·x), as target_k
    ks_rolled = cum - torch.cat([cum.new_zeros(1), cum[:-1]])
    short = target_k(n, density) - int(cum[-1])  # ~0; target_k keeps at least one element
    if short:
        ks_rolled[0] = (ks_rolled[0] + short).clamp(0, int(rolled[0]))
    return torch.minimum(torch.roll(ks_rolled, r), lens)


@functools.lru_cache(maxsize=4096)
def chunk_rank(num_samples: int, k: int, numel: int, miss: float) -> int:
    """Rank ``r`` of a chunk's threshold in its sample of ``num_samples`` magnitudes, for target ``k`` of
    ``numel`` elements: the smallest ``r`` with ``P(Binomial(num_samples, k / numel) ≥ r) ≤ miss``, i.e. the
    threshold exceeds the chunk's ``k``-th largest magnitude (fewer than ``k`` candidates) in at most ``miss`` of
    chunks. ``k`` itself when the sample is the whole chunk (the exact threshold)."""
    if num_samples >= numel:
        return max(1, min(k, numel))
    p = k / numel
    tail = 1.0  # P(hits >= r)
    for r in range(1, num_samples + 1):
        tail -= math.comb(num_samples, r - 1) * p ** (r - 1) * (1.0 - p) ** (num_samples - r + 1)
        if tail <= miss:
            return r
    return num_samples
