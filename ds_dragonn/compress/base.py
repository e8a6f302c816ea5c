"""The compressor interface shared by DRAGONN and the baselines (exact top-k, random-k: launch/bench/baselines.py).

A compressor takes one flattened 1-D gradient buffer and returns a :class:`Selection`: the indices it
keeps and their values. It never touches the residual: error feedback is applied around it
(``ds_dragonn.feedback``), in the fixed order compensate → compress → exchange → update residual.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from .budget import MAX_PAIRS_FACTOR, max_pairs, target_k  # noqa: F401  (MAX_PAIRS_FACTOR re-exported)
from .chunks import chunk_ks, chunk_layout

#: Marker of an empty hash-table slot: out of range for every buffer, so that every element, element 0
#: included, can be selected.
EMPTY_SLOT = -1

#: Buffers at least this long carry int64 indices; shorter ones int32 (half the index bytes on the wire).
INT64_INDEX_NUMEL = 2**31

class Selection(NamedTuple):
    """What a compressor keeps from one buffer of ``numel`` elements.

    Attributes:
        indices: (count,) int32 (numel < 2^31) or int64, distinct positions in [0, numel).
        values: (count,) the buffer's dtype, ``buffer[indices]``.
        threshold: 0-d float32 tensor on the buffer's device; the magnitude cut used (0 for random-k).
        k: target count, ``ceil(density * numel)`` (0 for an empty buffer).
        capacity: most pairs this selection may hold: ``min(table size, max_pairs(k))`` for DRAGONN (its
            table has ``ceil(table_factor * k)`` slots), k for top-k and random-k.
        whole: the last ``whole`` pairs are every element of a block sent whole (the age bound,
            ``compress/age_bound.py``), in bucket order (zeros included). Every rank has the same such positions,
            so an exchange may send their values without the indices (``exchange/allgather.py``).
    """
    indices: torch.Tensor
    values: torch.Tensor
    threshold: torch.Tensor
    k: int
    capacity: int
    whole: int = 0

    @property
    def count(self) -> int:
        return int(self.indices.numel())


def index_dtype(numel: int) -> torch.dtype:
    """int32 for buffers shorter than 2^31 elements, int64 otherwise."""
    return torch.int64 if numel >= INT64_INDEX_NUMEL else torch.int32


def trim(sel: Selection, cap: int) -> Selection:
    """``sel`` cut to its ``cap`` largest magnitudes (non-finite first); pairs keep their order.

    Equal magnitudes are decided by position in the selection (for DRAGONN the hash-table slot):
    deterministic, so every kernel and every rank cut the same way. What is cut stays in the residual.
    """
    c = sel.count
    if c <= cap:
        return sel
    mag = magnitude(sel.values)  # (c,) float32 >= 0: its bits order like its values
    pos = torch.arange(c, device=mag.device, dtype=torch.int64)
    keys = (mag.view(torch.int32).to(torch.int64) << 32) | (0xFFFF_FFFF - pos)  # ties: earlier slot first
    keep = torch.topk(keys, cap, sorted=False).indices.sort().values
    return Selection(sel.indices[keep], sel.values[keep], sel.threshold, sel.k, min(sel.capacity, cap))


def segment_seed(seed: int, s: int) -> int:
    """The seed of chunk (segment) ``s`` of a call with ``seed`` (48 bits, like the callers' seeds): chunks of
    equal length get different hash tables and samples."""
    return (int(seed) + (s + 1) * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF


def magnitude(flat: torch.Tensor) -> torch.Tensor:
    """|flat| in float32, with NaN and ±Inf mapped to +Inf: non-finite entries always rank first.

    Sending non-finite entries reproduces the dense allreduce (DeepSpeed's overflow check sees them).
    """
    mag = flat.abs().float()
    return torch.nan_to_num(mag, nan=math.inf, posinf=math.inf)


def empty_selection(flat: torch.Tensor, k: int = 0, capacity: int = 0) -> Selection:
    return Selection(
        indices=torch.empty(0, dtype=index_dtype(flat.numel()), device=flat.device),
        values=torch.empty(0, dtype=flat.dtype, device=flat.device),
        threshold=torch.zeros((), dtype=torch.float32, device=flat.device),
        k=k,
        capacity=capacity,
    )


class Compressor(ABC):
    """Selects the pairs to send from one flattened buffer.

    Args of :meth:`compress`:
        flat: 1-D tensor (any float dtype, any device, contiguous or not) of ``numel`` elements.
        seed: per-call seed; every rank derives it the same way (step, bucket), so runs are reproducible.
    """

    name: str = "base"
    #: True when a buffer holding NaN/±Inf always sends at least one of them (see ``ds_dragonn.pipeline``)
    finite_proof: bool = False

    def __init__(self, density: float, chunk: int | None = None):
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be None (one selection over the buffer) or an int >= 1, got {chunk!r}")
        self.density = float(density)
        #: chunk-wise selection (``compress/chunks.py``): entries per chunk; None: one selection over the buffer
        self.chunk = chunk

    @property
    def sends_non_finite(self) -> bool:
        """True when a buffer holding NaN/±Inf always sends at least one of them (``ds_dragonn.pipeline`` then
        skips its full non-finite pass). Chunk-wise, only while every chunk sends (``density × chunk ≥ 1``)."""
        return self.finite_proof and (self.chunk is None or self.density * self.chunk >= 1.0)

    def compress(self, flat: torch.Tensor, seed: int = 0) -> Selection:
        """Select from ``flat``; an empty buffer gives an empty selection. At most :func:`max_pairs` (k)
        pairs are returned, whatever the values (ties included: see :func:`trim`).

        Args:
            flat: (n,) float buffer.
            seed: per-call seed (equal on every rank).
        With ``chunk`` set (chunk-wise selection, ``compress/chunks.py``) each chunk sends at most its own
        ``k_c``, ``Σ k_c = k``.
        Raises:
            ValueError: ``flat`` is not 1-D. TypeError: ``flat`` is not floating point.
        """
        if flat.dim() != 1:
            raise ValueError(f"compressors take a flattened 1-D buffer, got shape {tuple(flat.shape)}")
        if not flat.is_floating_point():
            raise TypeError(f"compressors take a floating-point buffer, got {flat.dtype}")
        if self.chunk is not None:
            return self._compress_chunks(flat, seed)
        k = target_k(flat.numel(), self.density)
        if k == 0:
            return empty_selection(flat)
        return trim(self._select(flat, k, seed), max_pairs(k))

    def target(self, numel: int) -> int:
        """The target count k of a buffer of ``numel`` elements (chunk-wise: the same, ``Σ k_c``)."""
        return target_k(numel, self.density)

    def _compress_chunks(self, flat: torch.Tensor, seed: int) -> Selection:
        """Chunk-wise selection of ``flat`` (``compress/chunks.py``): at most ``k_c`` pairs per chunk."""
        k = target_k(flat.numel(), self.density)
        if k == 0:
            return empty_selection(flat)
        layout = chunk_layout(flat.numel(), self.chunk)
        return self._select_chunks(flat, layout, chunk_ks(layout, self.density, seed), seed)

    def _select_chunks(self, flat: torch.Tensor, layout, ks: torch.Tensor, seed: int) -> Selection:
        """:meth:`_select` on each chunk with its ``k_c`` (``ks``, (nchunks,) int64) and :func:`segment_seed`, cut to
        its ``k_c`` largest (:func:`trim`), indices shifted to buffer positions; ``k = capacity = Σ k_c``,
        ``threshold`` the smallest chunk's cut. Kernels override this."""
        n = flat.numel()
        idx, vals, thr = [], [], []
        for c, (lo, hi, kc) in enumerate(zip(layout.offsets[:-1], layout.offsets[1:], ks.tolist())):
            if kc == 0:
                continue
            sel = trim(self._select(flat[lo:hi], kc, segment_seed(seed, c)), kc)
            idx.append(sel.indices.to(index_dtype(n)) + lo)
            vals.append(sel.values)
            thr.append(sel.threshold.reshape(1))
        k = int(ks.sum())
        return Selection(torch.cat(idx) if idx else flat.new_empty(0, dtype=index_dtype(n)),
                         torch.cat(vals) if vals else flat.new_empty(0),
                         torch.cat(thr).min() if thr else torch.zeros((), dtype=torch.float32, device=flat.device),
                         k, k)

    @abstractmethod
    def _select(self, flat: torch.Tensor, k: int, seed: int) -> Selection:
        """Select about ``k ≥ 1`` pairs from the non-empty 1-D float buffer ``flat``."""

    def private_generator(self, device: torch.device, seed: int) -> torch.Generator:
        """A generator for this call only: never touches the global RNG (cf. PyTorch's PowerSGD)."""
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)
        return gen
