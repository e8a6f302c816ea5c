"""The exchange interface: a rank's selected pairs in, every rank's decodable pairs out.

The pipeline calls :meth:`Exchange.exchange` between the selection and the residual commit and does not know
which scheme runs (``allgather``, ``partitioned``, ``reduce_scatter``). Every scheme hands back a
:class:`Gathered`, the same on every rank. See docs/design.md, 'The exchange schemes'.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, List, NamedTuple, Optional, Sequence

import torch

from ..comm.base import CommBackend
from ..compress.base import Selection
from .ownership import Ownership
from .quantize import PLAIN, ValueCodec
from .wire import SCHEME_CODES, bucket_code, dense_allreduce_bytes, describe_code, dtype_code


class Gathered(NamedTuple):
    """The pairs every rank decodes after an exchange.

    Attributes:
        indices: per list, (c,) int32/int64 distinct bucket positions (one list per rank for
            ``allgather``, per owner for ``partitioned``).
        values: per list, (c,) values in the wire dtype.
        counts: pairs in each list.
        bytes_sent: bytes this rank put on the wire (headers included; ring model for allgathers, the
            blocks addressed to other ranks for all-to-alls).
        bytes_received: bytes this rank took off the wire, by the same rules.
        owner_pairs: ``partitioned`` only: pairs each owner received in the reduce-scatter (self
            included); ``max / mean`` is the owner imbalance.
        scale: the values were already multiplied by this (``partitioned`` with fp16 values: the owners
            send their sum ÷ P); the decode multiplies by ``postscale / scale``.
        sent: (c,) wire dtype: this rank's selection as every rank decodes it, in the selection's order,
            where that differs from the values given (quantized values, ``exchange/quantize.py``): the
            residual keeps ``kept − sent``. None: the values given were sent unchanged.
        finite: every value this rank sent was finite (read with the exchange's header, no read-back of its
            own): the sender's buffer then holds no NaN/Inf where its compressor sends them first.
    """
    indices: List[torch.Tensor]
    values: List[torch.Tensor]
    counts: List[int]
    bytes_sent: int
    bytes_received: int = 0
    owner_pairs: Sequence[int] = ()
    scale: float = 1.0
    sent: Optional[torch.Tensor] = None
    finite: bool = False


class BufferMismatchError(ValueError):
    """Ranks tried to reduce buffers of different sizes or dtypes."""


def check_agreement(numels: Sequence[int], codes: Sequence[int], rank: int) -> None:
    """Raise :class:`BufferMismatchError` (same text on every rank) unless all ranks gave one numel and dtype."""
    if len(set(numels)) > 1 or len(set(codes)) > 1:
        per_rank = ", ".join(f"rank {r}: {n} x {describe_code(c)}" for r, (n, c) in enumerate(zip(numels, codes)))
        raise BufferMismatchError(f"[rank {rank}] ranks disagree on the gradient buffer to reduce "
                                  f"({per_rank}); every rank must reduce the same model's gradients")


def check_buffer_agreement(numel: int, dtype: torch.dtype, backend: CommBackend, device: torch.device,
                           scheme: str = "allgather", key: Hashable = None) -> None:
    """One small allgather of ``(numel, dtype, exchange scheme, bucket code)``: every rank raises
    :class:`BufferMismatchError` naming what differs and each rank's value when they disagree. The bucket
    code (:func:`bucket_code` of ``key``) catches buckets of equal size holding different parameters. Run once
    per bucket, before the residual is touched and before the scheme's own collectives.
    """
    code = bucket_code(key) if key is not None else 0
    rows = backend.all_gather_ints([numel, dtype_code(dtype), SCHEME_CODES.get(scheme, -1), code], device)
    check_agreement([r[0] for r in rows], [r[1] for r in rows], backend.rank)
    schemes = [r[2] for r in rows]
    if len(set(schemes)) > 1:
        names = {v: k for k, v in SCHEME_CODES.items()}
        per_rank = ", ".join(f"rank {r}: {names.get(c, c)}" for r, c in enumerate(schemes))
        raise BufferMismatchError(f"[rank {backend.rank}] ranks disagree on 'dragonn.exchange' ({per_rank}); "
                                  f"every rank must use the same exchange scheme")
    codes = [r[3] for r in rows]
    if len(set(codes)) > 1:
        per_rank = ", ".join(f"rank {r}: {c:014x}" for r, c in enumerate(codes))
        raise BufferMismatchError(f"[rank {backend.rank}] ranks disagree on the bucket layout (digest of position, "
                                  f"dtype, length and parameter names: {per_rank}); every rank must train the same "
                                  f"parameters (the same ones frozen)")



class Exchange(ABC):
    """One exchange scheme over one transport (``backend``); may keep per-bucket state (``partitioned``).

    ``values`` (:class:`~ds_dragonn.exchange.quantize.ValueCodec`, ``advanced.values``) says how values
    travel: in the wire dtype (the default) or as int8/int4 codes with per-group scales."""

    name: str = "base"

    def __init__(self, backend: CommBackend, values: ValueCodec = PLAIN):
        self.backend = backend
        self.values = values

    @abstractmethod
    def exchange(self, key: Hashable, selection: Selection, numel: int, wire_dtype: torch.dtype,
                 seed: int, ownership: Optional[Ownership] = None) -> Gathered:
        """Exchange this rank's ``selection`` (values already in ``wire_dtype``) of the bucket ``key``.

        Args:
            key: the bucket's stable key (selects any per-bucket state of the scheme).
            selection: this rank's pairs; indices distinct, in [0, numel).
            numel: the bucket's length (must agree across ranks).
            wire_dtype: dtype of values on the wire.
            seed: the step's seed, equal on every rank.
            ownership: who reduces which index of this bucket, for a scheme whose owners the caller fixes
                (``reduce_scatter``: ZeRO's partitions); schemes that choose their own owners ignore it.
        Returns:
            :class:`Gathered`; with quantized values (``self.values``) its ``sent`` holds what every rank
            decodes of ``selection``, which the caller's residual must subtract.
        Raises:
            BufferMismatchError: on every rank, when ranks disagree on ``numel``, ``wire_dtype`` or the value
                format.
            CommError: a collective failed.
        """

    def dense_bytes(self, numel: int, itemsize: int, world_size: int) -> int:
        """What the dense collective this exchange replaces sends per rank (default: a ring allreduce,
        ``2(P-1)/P × numel × itemsize``)."""
        return dense_allreduce_bytes(numel, itemsize, world_size)

    @abstractmethod
    def max_bytes(self, numel: int, pairs: int, wire_dtype: torch.dtype, world_size: int) -> int:
        """Most bytes this rank sends (headers included, the same rules as ``Gathered.bytes_sent``) for a
        bucket of ``numel`` elements when every rank selects at most ``pairs`` pairs. The engine sends a
        bucket dense when this exceeds :meth:`dense_bytes` (policy ``auto``)."""

    def flush_into(self, key: Hashable, buf: torch.Tensor) -> None:
        """Add any state the scheme holds for ``key`` that is still owed to the sum into ``buf`` (this rank's
        share of a dense allreduce), and forget it. Default: the scheme holds nothing."""

    def end_step(self, applied: bool) -> None:
        """DeepSpeed applied (True) or skipped (False) the step whose exchanges ran since the last call:
        a scheme with state undoes a skipped step's changes to it. Default: the scheme holds nothing."""

    def rescale_(self, factor: float) -> None:
        """Multiply any residual the scheme holds by ``factor`` (a changed fp16 loss scale)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        """Restore what :meth:`state_dict` returned (tensors onto ``device`` if given)."""

    def reset(self) -> None:
        """Forget all per-bucket state."""
