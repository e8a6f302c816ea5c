"""The compressed allreduce of one flattened buffer: compensate → compress → exchange → update residual
→ decode → average. This is the only place that fixes that order. The residual is committed only once
the exchange has succeeded, so a failed exchange (e.g. ranks that disagree on the buffer) leaves the
residual as it was instead of recording pairs as sent that never left.
"""
from __future__ import annotations

import time
from typing import Hashable, NamedTuple

import torch

from .comm.base import CommBackend
from .compress.base import Compressor, Selection
from .decode import decode_sum
from .exchange.allgather import allgather_exchange
from .feedback import ErrorFeedback


class ReduceStats(NamedTuple):
    """Statistics of one compressed allreduce on this rank.

    Attributes:
        numel: buffer length (elements).
        k: target kept count, ``ceil(density * numel)``.
        kept: pairs this rank sent.
        capacity: most pairs the compressor may return (hash-table size for DRAGONN).
        bytes_sent: bytes this rank put on the wire.
        dense_bytes: what a ring allreduce of the buffer sends per rank, ``2(P-1)/P × numel × itemsize``.
        compress_ms: wall time of compensate + compress + residual update (ms; device-synchronised).
    """
    numel: int
    k: int
    kept: int
    capacity: int
    bytes_sent: int
    dense_bytes: int
    compress_ms: float


def dense_allreduce_bytes(numel: int, itemsize: int, world_size: int) -> int:
    """Bytes each rank sends in a ring allreduce of ``numel`` elements: ``2(P-1)/P × numel × itemsize``."""
    return int(2 * (world_size - 1) * numel * itemsize // max(world_size, 1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CompressedAllreduce:
    """Sparse allreduce of flattened buffers with error feedback.

    Args:
        compressor: selection method.
        backend: collective transport for the data-parallel group.
        error_feedback: residual store (``ErrorFeedback(enabled=False)`` to drop what is not sent).
    """

    def __init__(self, compressor: Compressor, backend: CommBackend, error_feedback: ErrorFeedback):
        self.compressor = compressor
        self.backend = backend
        self.error_feedback = error_feedback

    def __call__(self, flat: torch.Tensor, key: Hashable, seed: int, prescale: float = 1.0,
                 postscale: float = 1.0) -> ReduceStats:
        """Reduce ``flat`` in place across ranks.

        Args:
            flat: (n,) contiguous float buffer; on return holds ``postscale × Σ_ranks decoded pairs``.
            key: stable id of this buffer across steps (selects its residual).
            seed: per-step, per-buffer seed, equal on every rank.
            prescale: multiplies the local buffer before compensation (DeepSpeed's 1/predivide factor).
            postscale: multiplies the decoded sum (DeepSpeed's predivide/world_size factor).
        """
        n = flat.numel()
        if prescale != 1.0:
            flat.mul_(prescale)
        _sync(flat.device)
        t0 = time.perf_counter()
        compensated = self.error_feedback.compensate(key, flat)
        sel = self.compressor.compress(compensated, seed)
        wire_values = sel.values.to(flat.dtype)
        _sync(flat.device)
        compress_ms = (time.perf_counter() - t0) * 1e3

        sent = Selection(sel.indices, wire_values, sel.threshold, sel.k, sel.capacity)
        gathered = allgather_exchange(sent, n, flat.dtype, self.backend)
        t1 = time.perf_counter()
        self.error_feedback.update(key, compensated, sel.indices, wire_values)
        _sync(flat.device)
        compress_ms += (time.perf_counter() - t1) * 1e3
        out = decode_sum(n, gathered.indices, gathered.values, flat.dtype, flat.device)
        if postscale != 1.0:
            out.mul_(postscale)
        flat.copy_(out)
        return ReduceStats(numel=n, k=sel.k, kept=sel.count, capacity=sel.capacity,
                           bytes_sent=gathered.bytes_sent,
                           dense_bytes=dense_allreduce_bytes(n, flat.element_size(), self.backend.world_size),
                           compress_ms=compress_ms)
