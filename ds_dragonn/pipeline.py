"""The compressed allreduce of one bucket: compensate → compress → exchange → commit residual → decode.

This is the only place that fixes that order. The residual is committed only once the exchange has succeeded, so a
failed exchange leaves ``old residual + gradient`` in it. Memory passes per step: see docs/design.md, 'The data path
of one bucket' (Step budget).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Hashable, Iterator, NamedTuple, Sequence, Union

import torch

from .comm.base import CommBackend
from .compress.age_bound import with_age_block
from .compress.base import Compressor, Selection
from . import sparse_ops
from .decode import SparseDecoder
from .exchange import AllgatherExchange, Exchange, check_buffer_agreement, to_wire
from .exchange.quantize import PLAIN, ValueCodec
from .feedback import ErrorFeedback
from .momentum import LocalMomentum


class ReduceStats(NamedTuple):
    """Statistics of one compressed allreduce on this rank.

    Attributes:
        numel: buffer length (elements).
        k: target kept count, ``ceil(density * numel)``.
        kept: pairs this rank sent.
        capacity: most pairs the compressor may return (hash-table size for DRAGONN).
        bytes_sent: bytes this rank put on the wire.
        dense_bytes: what the dense collective replaced sends per rank: a ring allreduce,
            ``2(P-1)/P × numel × itemsize`` (for ZeRO's reduce-scatter ``(P-1)/P × numel × itemsize``).
        compress_ms: compensate + select + residual, in ms (the compression overhead).
        compensate_ms, select_ms, exchange_ms, residual_ms, decode_ms: wall time of each phase in ms
            (device-synchronised on CUDA). ``exchange_ms`` includes waiting for the slowest rank, and for
            the partitioned exchange the owners' reduction and re-selection.
        bytes_received: bytes this rank took off the wire.
        imbalance: partitioned exchange: max over owners of the pairs received ÷ their mean (0 otherwise).
        timed: the ``*_ms`` fields hold this reduction's times (False: an untimed CUDA reduction, all 0.0;
            see :class:`PhaseClock`).
    """
    numel: int
    k: int
    kept: int
    capacity: int
    bytes_sent: int
    dense_bytes: int
    compress_ms: float
    compensate_ms: float = 0.0
    select_ms: float = 0.0
    exchange_ms: float = 0.0
    residual_ms: float = 0.0
    decode_ms: float = 0.0
    bytes_received: int = 0
    imbalance: float = 0.0
    timed: bool = True


class Reduced(NamedTuple):
    """Result of :meth:`CompressedAllreduce.reduce`: the averaged buffer and the statistics."""
    out: torch.Tensor
    stats: ReduceStats


TIMING_ENV = "DS_DRAGONN_PHASE_TIMING"  # "1": time every reduction (benchmarks, profiling)
_timing = {"forced": os.environ.get(TIMING_ENV, "") not in ("", "0"), "next": False}


def request_timing(on: bool) -> None:
    """Time (device-synchronised) the phases of the reductions that follow, until called again with False:
    the reporter asks for it before a reduction it will log (``log_interval``), benchmarks for all."""
    _timing["next"] = bool(on)


def timing_requested() -> bool:
    """Whether phases are timed now: :func:`request_timing`, :func:`timed_scope`, or
    ``DS_DRAGONN_PHASE_TIMING=1`` in the environment."""
    return _timing["forced"] or _timing["next"] or _timing.get("scope", False)


@contextlib.contextmanager
def timed_scope(on: bool) -> Iterator[None]:
    """Time the reductions inside (``on``): the auto policy's probes, whose times decide a bucket's path."""
    before = _timing.get("scope", False)
    _timing["scope"] = before or bool(on)
    try:
        yield
    finally:
        _timing["scope"] = before


class PhaseClock:
    """Phase timer: timed, it synchronises a CUDA device at each mark; untimed, every CUDA lap is 0.0.

    Args:
        device: the device whose work is timed.
        timed: time this clock's laps (None: :func:`timing_requested`).
    """

    def __init__(self, device: torch.device, timed: bool | None = None):
        self.cuda = device.type == "cuda"
        self.device = device
        self.timed = timing_requested() if timed is None else bool(timed)
        self.last = self._now()

    def _now(self) -> float:
        if not self.cuda:
            return time.perf_counter()
        if not self.timed:
            return 0.0
        torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self) -> float:
        """ms since the previous mark (0.0 on an untimed CUDA clock)."""
        now = self._now()
        ms, self.last = (now - self.last) * 1e3, now
        return ms


class Gradients:
    """What ``compress: gradient`` compresses: the gradients themselves. The momentum mode's
    :class:`~ds_dragonn.momentum.LocalMomentum` has the same :meth:`update`, which folds them into the local
    momentum and returns that instead."""

    @staticmethod
    def update(key: Hashable, tensors: Sequence[torch.Tensor], dtype: torch.dtype, prescale: float = 1.0,
               zero_inputs: bool = False) -> tuple:
        """``(tensors, prescale)`` unchanged (nothing is kept; ``zero_inputs`` is left to the compensation)."""
        return tensors, prescale


#: the gradient mode's :class:`Gradients` (stateless: one for every pipeline)
GRADIENTS = Gradients()


class CompressedAllreduce:
    """Sparse allreduce of flattened buckets with error feedback.

    Args:
        compressor: selection method.
        backend: collective transport for the data-parallel group.
        error_feedback: residual store (``ErrorFeedback(enabled=False)`` to drop what is not sent).
        exchange: the exchange scheme over ``backend`` (default :class:`~ds_dragonn.exchange.AllgatherExchange`).
        target: what the residual accumulates: :data:`GRADIENTS` (``compress: gradient``), or each rank's local
            momentum (``compress: momentum``, a :class:`~ds_dragonn.momentum.LocalMomentum`), into which every
            reduction first folds the gradients.
        max_age: the age bound in steps (``advanced.max_age``; 0: none): each reduction given an ``age_step``
            also sends that step's block of the bucket whole (``compress/age_bound.py``).
    """

    def __init__(self, compressor: Compressor, backend: CommBackend, error_feedback: ErrorFeedback,
                 exchange: Exchange | None = None, target: LocalMomentum | Gradients = GRADIENTS, max_age: int = 0):
        self.compressor, self.backend = compressor, backend
        self.error_feedback, self.target = error_feedback, target
        self.max_age = int(max_age)
        self.exchange = exchange if exchange is not None else AllgatherExchange(backend)
        self.decoder = SparseDecoder()
        self._agreed: set = set()  # (key, numel, dtype) checked with every rank

    def reduce(self, tensors: Union[torch.Tensor, Sequence[torch.Tensor]], key: Hashable, seed: int,
               prescale: float = 1.0, postscale: float = 1.0, dtype: torch.dtype | None = None,
               into_inputs: bool = False, ownership=None, age_step: int | None = None) -> Reduced:
        """Reduce the bucket ``tensors`` (their concatenation) across ranks.

        Args:
            tensors: one tensor or the bucket's gradients (any shapes, one device); not modified unless
                ``into_inputs``.
            key: stable id of this bucket across steps (selects its residual and decode buffer).
            seed: per-step, per-bucket seed, equal on every rank.
            prescale: multiplies the local gradients before compensation (DeepSpeed's 1/predivide factor).
            postscale: multiplies the decoded sum (DeepSpeed's predivide/world_size factor).
            dtype: wire (communication) dtype; default the gradients' dtype.
            into_inputs: write the result into ``tensors`` themselves (zeroed during compensation, the
                pairs decoded into them): no decode buffer and no copy back. Needs
                :meth:`can_reduce_into` true.
            ownership: the bucket's owner map for the ``reduce_scatter`` exchange (ZeRO's partitions:
                :class:`~ds_dragonn.exchange.reduce_scatter.RangeOwnership`); other schemes ignore it.
            age_step: the age bound's clock, equal on every rank: the index of this compressed step, less the
                steps skipped on overflow (``HookBase.age_clock``; local steps: the round). With ``max_age`` it picks
                the block sent whole (None: no block).
        Returns:
            :class:`Reduced`; ``out`` is a persistent (n,) buffer of ``dtype`` holding
            ``postscale × Σ_ranks decoded pairs``, valid until this key's next reduction (None with
            ``into_inputs``: the tensors hold the result).
        Raises:
            BufferMismatchError: on every rank, when ranks disagree on the bucket's length, its dtype, the
                exchange scheme or the bucket key (its parameters; checked before the residual is touched).
            CommError: a collective failed.
        """
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        n = sum(t.numel() for t in tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        dtype = dtype or (tensors[0].dtype if tensors else torch.float32)
        if (key, n, dtype) not in self._agreed:
            check_buffer_agreement(n, dtype, self.backend, device, self.exchange.name, key)
            self._agreed.add((key, n, dtype))

        clock = PhaseClock(device)
        inputs = tensors
        # the residual accumulates what is compressed: the gradient, or the local momentum (which zeroes the inputs)
        tensors, prescale = self.target.update(key, tensors, dtype, prescale, zero_inputs=into_inputs)
        zero = into_inputs and bool(tensors) and tensors[0] is inputs[0]  # (else the momentum's update zeroed them)
        compensated = self.error_feedback.compensate_(key, tensors, dtype, prescale, zero_inputs=zero)
        compensate_ms = clock.lap()
        sel = self.compressor.compress(compensated, seed)
        if self.max_age and age_step is not None:
            sel = with_age_block(sel, compensated, self.max_age, age_step)
        wire_values = to_wire(sel.values, dtype)
        select_ms = clock.lap()

        sent = Selection(sel.indices, wire_values, sel.threshold, sel.k, sel.capacity, sel.whole)
        gathered = self.exchange.exchange(key, sent, n, dtype, seed, ownership)
        exchange_ms = clock.lap()

        # quantized values: what every rank decodes differs from wire_values; its rounding stays in the residual
        sent_values = gathered.sent if gathered.sent is not None else wire_values
        self.error_feedback.commit(key, sel.indices, sel.values, sent_values)
        # a buffer with a NaN/Inf sends at least one of them (they rank first), so finite sent values (their
        # flag came with the exchange's header: no read-back of its own) prove a finite buffer without a full
        # pass; otherwise clear what stayed in the residual
        if self.error_feedback.enabled and not (
                gathered.finite and getattr(self.compressor, "sends_non_finite", False)):
            self.error_feedback.clear_non_finite(key)
        residual_ms = clock.lap()

        postscale = postscale / gathered.scale  # values the exchange already scaled
        if into_inputs:
            out = None
            self.decoder.decode_into(inputs, gathered.indices, gathered.values, postscale)
        else:
            out = self.decoder.decode(key, n, gathered.indices, gathered.values, dtype, device, postscale)
        decode_ms = clock.lap()
        stats = ReduceStats(numel=n, k=sel.k, kept=sel.count, capacity=sel.capacity,
                            bytes_sent=gathered.bytes_sent,
                            dense_bytes=self.exchange.dense_bytes(n, dtype.itemsize, self.backend.world_size),
                            compress_ms=compensate_ms + select_ms + residual_ms, compensate_ms=compensate_ms,
                            select_ms=select_ms, exchange_ms=exchange_ms, residual_ms=residual_ms,
                            decode_ms=decode_ms, bytes_received=gathered.bytes_received,
                            imbalance=_imbalance(gathered.owner_pairs), timed=clock.timed or not clock.cuda)
        return Reduced(out, stats)

    def can_reduce_into(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> bool:
        """Whether :meth:`reduce` can decode into ``tensors``: :meth:`SparseDecoder.serves
        <ds_dragonn.decode.SparseDecoder.serves>`, wire dtype equal to theirs, and error feedback on."""
        return (self.error_feedback.enabled and bool(tensors)
                and tensors[0].dtype == dtype and SparseDecoder.serves(tensors))

    def release(self, key: Hashable) -> None:
        """Free ``key``'s residual; what it held is dropped."""
        self.error_feedback.release(key)

    def reduce_dense(self, tensors: Sequence[torch.Tensor], key: Hashable, prescale: float = 1.0,
                     postscale: float = 1.0, dtype: torch.dtype | None = None, codec: ValueCodec = PLAIN,
                     raw: bool = False, flush: bool = False) -> torch.Tensor:
        """Dense allreduce of ``residual + prescale × gradients``, which empties the residual (flush).

        Used when a compressed bucket goes dense (auto policy), and for every dense reduction after the warm-up in
        the momentum mode; the residual keeps only the wire dtype's rounding. See docs/design.md, 'The auto policy'.

        Args:
            codec: how the sum's values travel (:class:`~ds_dragonn.exchange.quantize.ValueCodec`): the wire dtype
                or int8/int4 codes (``advanced.dense_values``); their rounding stays in the residual.
            raw: reduce the gradients themselves even in the momentum mode (``key`` then names its own residual).
            flush: the residual held unsent gradient; with ``ErrorFeedback.undo_sent`` what this sends is logged.
        Returns:
            A new (n,) tensor of ``dtype``: ``postscale × Σ_ranks (residual + prescale × gradients)``.
        """
        tensors = list(tensors)
        dtype = dtype or tensors[0].dtype
        tensors, prescale = (GRADIENTS if raw else self.target).update(key, tensors, dtype, prescale)
        compensated = self.error_feedback.compensate_(key, tensors, dtype, prescale)
        # (before the owners' server residual joins it: the exchange undoes that part itself)
        before = compensated.clone() if flush and self.error_feedback.undo_sent else None
        self.exchange.flush_into(key, compensated)
        out = codec.allreduce_(compensated, self.backend, dtype, keep=self.error_feedback.enabled)
        if self.error_feedback.enabled:
            self.error_feedback.clear_non_finite(key)
        if postscale != 1.0:
            out.mul_(postscale)
        if before is not None:  # what left the residual: added back if DeepSpeed skips the step
            self.error_feedback.sent_log.add(key, None, before.sub_(compensated))
        return out

    def residual_of(self, key: Hashable, numel: int, device: torch.device | None = None) -> torch.Tensor | None:
        """Bucket ``key``'s residual, (numel,) in float32 or wider (what waits to be sent), or None before its first
        compressed reduction (or with error feedback off). The buffer itself: do not modify it. (``device``: for
        the node-aware pipeline's signature; no collective here.)"""
        residual = self.error_feedback.residuals.get(key) if self.error_feedback.enabled else None
        return residual if residual is not None and residual.numel() == numel else None

    def __call__(self, flat: torch.Tensor, key: Hashable, seed: int, prescale: float = 1.0,
                 postscale: float = 1.0) -> ReduceStats:
        """Reduce the (n,) buffer ``flat`` in place (:meth:`reduce` plus a copy back); returns the statistics."""
        out, stats = self.reduce(flat, key, seed, prescale, postscale, flat.dtype)
        flat.copy_(out)
        return stats


def _imbalance(owner_pairs) -> float:
    total = sum(owner_pairs)
    return max(owner_pairs) * len(owner_pairs) / total if total else 0.0


__all__ = ["CompressedAllreduce", "GRADIENTS", "Gradients", "PhaseClock", "ReduceStats", "Reduced"]
