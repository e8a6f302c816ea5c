"""Chunk-wise selection: every fixed-size chunk of a bucket sends its own top-k (``advanced.selection: chunked``).

One threshold over a whole bucket sends where the gradient mass is; a layer whose gradients are small in absolute
terms waits, up to ~1/density steps at a time. SparseLoCo (Sarfi et al. 2025) instead cuts the buffer into chunks
of 4096 entries and sends the top-k of each chunk, so no part of the model waits longer than any other. Here the
chunks are the segments of a :class:`ChunkLayout` (for DRAGONN (Wang et al., ICML 2022) one threshold and one hash
table per chunk, in one pass with no sort), with two rules of their own:

* **Budget.** Chunk ``c`` of ``[b_c, e_c)`` gets ``k_c = T(e'_c) − T(b'_c)`` with ``T(x) = ceil(density · x)``
  over the chunks' cumulative lengths in an order rotated by the call's seed (:func:`chunk_ks`): ``Σ k_c =
  ceil(density · n)``, the global selection's ``k`` (the same bytes), and each ``k_c`` is ``density × length``
  rounded down or up. Where ``density × length < 1`` the chunks take turns (the rotation changes every step).
* **Cap.** A chunk sends at most its ``k_c`` pairs: the largest magnitudes, ties to the earlier table slot
  (``base.trim``'s order). So a buffer never sends more than ``k`` pairs.

DRAGONN per chunk (:func:`chunk_rank`): the threshold is the ``r``-th largest of ``CHUNK_SAMPLE`` (64) sampled
magnitudes, with ``r`` chosen so that the threshold lands above the chunk's ``k_c``-th largest magnitude in at
most ``CHUNK_MISS`` (1 %) of chunks: it deliberately lets several times ``k_c`` candidates through. That costs
scan time only: a collision keeps the larger magnitude, so an element among a chunk's top ``k_c`` loses its slot
only to a larger one, whatever the number of smaller candidates, and the cap keeps the ``k_c`` largest winners.
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
