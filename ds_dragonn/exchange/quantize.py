"""Quantized values on the wire: symmetric int8 / int4 codes with one float32 scale per group of values.

A list of ``c`` values travels as ``ceil(c / GROUP)`` float32 scales (absmax of each group ÷ ``qmax``) then ``c``
codes (int8: qmax 127; int4: two per byte, qmax 7), each array aligned to ``wire.ALIGN``. Every rank decodes
the same values bit for bit; the rounding stays in the sender's residual (error feedback, Karimireddy et al.
2019). Group-wise absmax scales follow ZeRO++ qgZ (Wang et al. 2023) and SparseLoCo (Sarfi et al. 2025). A group
holding NaN/±Inf gets a NaN scale. See docs/design.md, 'Quantized values'.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import NamedTuple, Optional, Sequence

import torch

from .dense_quantized import quantized_allreduce
from .wire import ALIGN, align, to_wire

#: Values per float32 scale, in travel order (sorted positions: neighbours in the bucket share a scale).
GROUP = 64


class ValueFormat(str, Enum):
    """How values travel: ``dtype`` (the communication dtype, unchanged), ``int8`` or ``int4`` with per-group
    scales. ``auto`` is the config's default, resolved per run (``plan.resolve_defaults``); a codec reads an
    unresolved ``auto`` as ``dtype``."""
    auto = "auto"
    dtype = "dtype"
    int8 = "int8"
    int4 = "int4"


_BITS = {ValueFormat.int8: 8, ValueFormat.int4: 4}


class Quantized(NamedTuple):
    """One list of values as codes and scales.

    Attributes:
        codes: (c,) int8 in ``[−qmax, qmax]``.
        scales: (ceil(c / group),) float32; NaN for a group holding a non-finite value.
    """
    codes: torch.Tensor
    scales: torch.Tensor


def qmax(bits: int) -> int:
    """Largest code magnitude of a symmetric ``bits``-bit format: 127 (8), 7 (4)."""
    return (1 << (bits - 1)) - 1


def num_groups(count: int, group: int = GROUP) -> int:
    """Scales of a list of ``count`` values."""
    return -(-int(count) // group)


def quantize(values: torch.Tensor, bits: int, group: int = GROUP) -> Quantized:
    """Symmetric round-to-nearest quantization with one absmax scale per ``group`` consecutive values.

    Args:
        values: (c,) any float dtype (computed in float32).
        bits: 8 or 4.
        group: values per scale.
    Returns:
        :class:`Quantized`; a group of zeros has scale 0 and codes 0.
    """
    q = qmax(bits)
    v = values.float()
    c = v.numel()
    g = num_groups(c, group)
    padded = torch.zeros(g * group, dtype=torch.float32, device=v.device)
    padded[:c] = v
    blocks = padded.view(g, group)
    amax = blocks.abs().amax(dim=1)  # NaN / Inf propagate
    scales = torch.where(torch.isfinite(amax), amax / q, torch.full_like(amax, float("nan")))
    ratio = torch.nan_to_num(blocks / scales.unsqueeze(1), nan=0.0, posinf=0.0, neginf=0.0)
    codes = ratio.round_().clamp_(-q, q).to(torch.int8).flatten()[:c]
    return Quantized(codes, scales)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, group: int = GROUP) -> torch.Tensor:
    """``code × scale`` in float32, rounded to ``dtype``: (c,) ``dtype``. The same operations on every rank."""
    c = codes.numel()
    if c == 0:
        return torch.empty(0, dtype=dtype, device=codes.device)
    per = scales.repeat_interleave(group, output_size=scales.numel() * group)[:c]
    return (codes.float() * per).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(c,) int8 codes in [−7, 7] → (ceil(c/2),) uint8: code + 8 in a nibble, even positions low, odd high."""
    c = codes.numel()
    nib = torch.zeros(2 * -(-c // 2), dtype=torch.uint8, device=codes.device)
    nib[:c] = (codes + 8).to(torch.uint8)
    pairs = nib.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: the first ``count`` codes as (count,) int8."""
    nib = torch.stack([packed & 15, packed >> 4], dim=1).flatten()[:count]
    return nib.to(torch.int8) - 8


class ValueCodec(ABC):
    """How the values of one list travel: writes and reads its values block, sizes it, and sums a dense buffer.

    One class per kind, chosen once by :func:`value_codec`: :class:`DtypeCodec` and :class:`QuantizedCodec`.
    Attributes:
        format: the :class:`ValueFormat`.
        code: small integer naming the format in wire headers (0 dtype, 8, 4): ranks on different formats fail
            fast.
        quantized: whether values change on the wire.
        split_bytes: most bytes a values block grows by when one list is cut into several blocks.
    """
    code = 0
    quantized = False
    split_bytes = 0

    def __init__(self, fmt: ValueFormat):
        self.format = fmt

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.format.value!r})"

    @abstractmethod
    def block_bytes(self, capacity: int, wire_dtype: torch.dtype) -> int:
        """Bytes of a values block with room for ``capacity`` values (aligned; 0 for none)."""

    @abstractmethod
    def write(self, block: torch.Tensor, values: torch.Tensor, capacity: int) -> torch.Tensor:
        """Write ``values`` into ``block`` and return them as every rank will read them.

        Args:
            block: (block_bytes(capacity, wire_dtype),) uint8, 8-byte aligned.
            values: (c,) in the wire dtype, ``c <= capacity``, in travel order.
            capacity: the block's room (fixes where the codes start).
        Returns:
            (c,) wire dtype: ``values`` themselves (dtype) or their dequantization.
        """

    @abstractmethod
    def read(self, block: torch.Tensor, count: int, capacity: int, wire_dtype: torch.dtype) -> torch.Tensor:
        """The ``count`` values :meth:`write` put into ``block`` (same capacity): (count,) ``wire_dtype``."""

    @abstractmethod
    def as_sent(self, decoded: Sequence[torch.Tensor], order: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """An exchange's ``Gathered.sent`` from what :meth:`write` returned for each of its blocks (in travel
        order; ``order``: the permutation that put the caller's values in travel order, see :func:`unpermute`):
        None where the values travel unchanged (or there are none), else (c,) the values every rank decodes."""

    @abstractmethod
    def allreduce_(self, x: torch.Tensor, backend, dtype: torch.dtype, keep: bool) -> torch.Tensor:
        """Dense sum of ``x`` over the ranks of ``backend`` (a :class:`~ds_dragonn.comm.base.CommBackend`) with its
        values in this format: a new (n,) ``dtype`` tensor. ``x``: (n,) float32 or wider; with ``keep`` it is
        left holding what the wire took from it (its rounding, for the residual), else it is not modified."""


class DtypeCodec(ValueCodec):
    """``dtype`` (an unresolved ``auto`` too): the values travel in the wire dtype, unchanged."""

    def block_bytes(self, capacity: int, wire_dtype: torch.dtype) -> int:
        return align(int(capacity) * wire_dtype.itemsize)

    def write(self, block: torch.Tensor, values: torch.Tensor, capacity: int) -> torch.Tensor:
        block[:values.numel() * values.element_size()].view(values.dtype).copy_(values)
        return values

    def read(self, block: torch.Tensor, count: int, capacity: int, wire_dtype: torch.dtype) -> torch.Tensor:
        return block[:count * wire_dtype.itemsize].view(wire_dtype)

    def as_sent(self, decoded: Sequence[torch.Tensor], order: Optional[torch.Tensor] = None) -> None:
        return None

    def allreduce_(self, x: torch.Tensor, backend, dtype: torch.dtype, keep: bool) -> torch.Tensor:
        wire = to_wire(x, dtype)
        if wire.data_ptr() == x.data_ptr():  # same dtype: reduce a copy, ``x`` stays
            wire = wire.clone()
        if keep:
            x.sub_(wire.to(x.dtype))
        backend.all_reduce_sum_(wire)
        return wire


class QuantizedCodec(ValueCodec):
    """``int8`` / ``int4``: codes with one float32 scale per ``group`` values; the dense sum is
    :func:`~ds_dragonn.exchange.dense_quantized.quantized_allreduce`.

    Args:
        fmt: ``ValueFormat.int8`` or ``ValueFormat.int4``.
        group: values per scale (:data:`GROUP`).
    """
    quantized = True
    split_bytes = ALIGN + 4  # one more scale for a group cut by a block's end, aligned

    def __init__(self, fmt: ValueFormat, group: int = GROUP):
        super().__init__(fmt)
        self.bits = self.code = _BITS[fmt]
        self.group = int(group)

    def _regions(self, capacity: int) -> tuple:
        return align(4 * num_groups(capacity, self.group)), align(-(-int(capacity) * self.bits // 8))

    def block_bytes(self, capacity: int, wire_dtype: torch.dtype) -> int:
        return sum(self._regions(capacity)) if capacity else 0

    def write(self, block: torch.Tensor, values: torch.Tensor, capacity: int) -> torch.Tensor:
        c = values.numel()
        if c == 0:
            return values
        q = quantize(values, self.bits, self.group)
        sb, _ = self._regions(capacity)
        block[:4 * q.scales.numel()].view(torch.float32).copy_(q.scales)
        codes = q.codes.view(torch.uint8) if self.bits == 8 else pack_int4(q.codes)
        block[sb:sb + codes.numel()].copy_(codes)
        return dequantize(q.codes, q.scales, values.dtype, self.group)

    def read(self, block: torch.Tensor, count: int, capacity: int, wire_dtype: torch.dtype) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, dtype=wire_dtype, device=block.device)
        sb, _ = self._regions(capacity)
        scales = block[:4 * num_groups(count, self.group)].view(torch.float32)
        if self.bits == 8:
            codes = block[sb:sb + count].view(torch.int8)
        else:
            codes = unpack_int4(block[sb:sb + -(-count // 2)], count)
        return dequantize(codes, scales, wire_dtype, self.group)

    def as_sent(self, decoded: Sequence[torch.Tensor], order: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        return unpermute(torch.cat(list(decoded)), order) if decoded else None

    def allreduce_(self, x: torch.Tensor, backend, dtype: torch.dtype, keep: bool) -> torch.Tensor:
        red = quantized_allreduce(x, backend, self)
        if keep:  # both roundings: this rank's and, as an owner, the sum's
            x.sub_(red.sent.to(x.dtype))
            s, e = red.owned
            x[s:e].add_(red.owner_rounding.to(x.dtype))
        return to_wire(red.out, dtype)


#: The default: values in the communication dtype.
PLAIN = DtypeCodec(ValueFormat.auto)

_CODECS = {ValueFormat.auto: DtypeCodec, ValueFormat.dtype: DtypeCodec, ValueFormat.int8: QuantizedCodec,
           ValueFormat.int4: QuantizedCodec}


def value_codec(fmt: Optional[object] = None) -> ValueCodec:
    """The codec of a ``values`` setting: a :class:`ValueFormat` or its name (None: :data:`PLAIN`).

    Raises:
        ValueError: an unknown format name.
    """
    if fmt is None:
        return PLAIN
    fmt = ValueFormat(fmt.value if isinstance(fmt, Enum) else fmt)
    return _CODECS[fmt](fmt)


def unpermute(travel: torch.Tensor, order: Optional[torch.Tensor]) -> torch.Tensor:
    """Values in travel order ``travel = x[order]`` back in ``x``'s order (``order`` None: unchanged)."""
    if order is None:
        return travel
    out = torch.empty_like(travel)
    out[order] = travel
    return out


__all__ = ["DtypeCodec", "GROUP", "PLAIN", "Quantized", "QuantizedCodec", "ValueCodec", "ValueFormat", "dequantize",
           "num_groups", "pack_int4", "qmax", "quantize", "unpack_int4", "unpermute", "value_codec"]
