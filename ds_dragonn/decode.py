"""Decode: sum every rank's (index, value) pairs into one dense buffer, then average.

Pairs from different ranks that hit the same index are *summed* (``index_add_``), rank after rank
(deterministic, bit-identical on every rank), and the sum is scaled as DeepSpeed's dense path scales its
allreduced sum. :class:`SparseDecoder` clears and scales only the previous step's ``P × k`` positions (O(P·k),
not O(n), unless somebody wrote into its buffer). fp16 buckets are summed in float32 and only the average is
rounded (a sum of P values can exceed 65504 where the average does not).
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Sequence

import torch

from . import sparse_ops
from .compress.kernels import cpu_table
from .buffers import persistent_zeros


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype decoded sums are formed in: float32 for fp16 (whose range a sum of P values can exceed),
    the buffer's own dtype otherwise (bf16 has float32's range)."""
    return torch.float32 if dtype == torch.float16 else dtype


def decode_sum(numel: int, indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               dtype: torch.dtype, device: torch.device, postscale: float = 1.0) -> torch.Tensor:
    """Dense sum of sparse contributions in a new buffer (reference; :class:`SparseDecoder` is the fast path).

    Args:
        numel: length n of the dense buffer.
        indices: per rank, (c_r,) int32/int64 distinct positions in [0, n).
        values: per rank, (c_r,) values (any float dtype; cast to ``dtype``).
        dtype, device: of the result.
        postscale: multiplies the sum (before the rounding to ``dtype``).
    Returns:
        (n,) tensor: ``out[i] = postscale × sum over ranks r and j with indices[r][j] == i of values[r][j]``
        (formed in :func:`accumulation_dtype`, then rounded to ``dtype``).
    """
    acc = accumulation_dtype(dtype)
    out = torch.zeros(numel, dtype=acc, device=device)
    for idx, val in zip(indices, values):
        if idx.numel():
            out.index_add_(0, idx.to(device=device, dtype=torch.long), val.to(device=device, dtype=acc))
    if postscale != 1.0:
        out.mul_(postscale)
    return out.to(dtype)


def check_indices(indices: Sequence[torch.Tensor], numel: int) -> None:
    """Raise ValueError when a rank's indices fall outside [0, numel) (a corrupt or mismatched peer).

    CPU indices are checked on the host before any write (the CPU library writes through raw addresses).
    Device indices are checked on the device, without a read-back: an out-of-range index fails the step with
    a device-side assertion (torch's own indexed writes check their bounds the same way)."""
    live = [idx for idx in indices if idx.numel()]
    if not live:
        return
    if live[0].device.type == "cpu":
        cpu_table.check_bounds(indices, numel)
        return
    for idx in live:
        torch._assert_async((idx.min() >= 0) & (idx.max() < numel),
                            f"decode: indices outside the bucket's [0, {numel}): a corrupt exchange")


class SparseDecoder:
    """Persistent per-bucket decode buffers, cleared and scaled sparsely."""

    def __init__(self):
        self._out: Dict[Hashable, torch.Tensor] = {}
        self._touched: Dict[Hashable, List[torch.Tensor]] = {}  # positions the last decode wrote
        self._version: Dict[Hashable, int] = {}  # the buffer's _version right after that decode
        self._acc: Dict[Hashable, torch.Tensor] = {}  # fp16 buckets: the float32 buffer the sums are formed in

    def decode(self, key: Hashable, numel: int, indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               dtype: torch.dtype, device: torch.device, postscale: float = 1.0) -> torch.Tensor:
        """``postscale × decode_sum(...)`` in the bucket's persistent buffer (bit-identical to it).

        Args: as :func:`decode_sum`; ``postscale`` multiplies the sum (DeepSpeed's averaging factor),
            after the summation, as DeepSpeed's dense path does.
        Returns:
            The persistent (n,) buffer of ``dtype``; valid until the next ``decode`` of the same key.
        Raises:
            ValueError: a rank's indices fall outside [0, numel) (nothing is written).
        """
        check_indices(indices, numel)
        out = self._out.get(key)
        if out is None or out.numel() != numel or out.dtype != dtype or out.device != device:
            out = persistent_zeros(numel, dtype, device)
            self._out[key] = out
        elif out._version != self._version.get(key):
            out.zero_()  # written by somebody else since our last decode
        else:
            for idx in self._touched.get(key, ()):
                sparse_ops.zero_(out, idx)
        # fp16: the sums go into a float32 buffer (zero outside the last decode's positions) and only the
        # scaled result is rounded into ``out``; other dtypes sum in ``out`` itself
        acc = out if accumulation_dtype(dtype) == dtype else self._widened(key, out)
        touched = []
        for idx, val in zip(indices, values):
            if idx.numel():
                idx = idx.to(device=device)
                sparse_ops.add_(acc, idx, val)
                touched.append(idx)
        if touched and (postscale != 1.0 or acc is not out):
            # read every decoded sum before writing any: an index sent by several ranks is then
            # written several times with the same value
            pos = touched[0] if len(touched) == 1 else torch.cat(touched)
            sparse_ops.set_(out, pos, sparse_ops.gather_scaled(acc, pos, postscale))
        self._touched[key] = touched
        self._version[key] = out._version
        return out

    def _widened(self, key: Hashable, out: torch.Tensor) -> torch.Tensor:
        """The float32 buffer an fp16 bucket's sums are formed in, its last decode's positions cleared."""
        acc = self._acc.get(key)
        if acc is None or acc.numel() != out.numel() or acc.device != out.device:
            acc = self._acc[key] = persistent_zeros(out.numel(), accumulation_dtype(out.dtype), out.device)
        else:
            for idx in self._touched.get(key, ()):
                sparse_ops.zero_(acc, idx)
        return acc

    @staticmethod
    def decode_into(tensors: Sequence[torch.Tensor], indices: Sequence[torch.Tensor],
                    values: Sequence[torch.Tensor], postscale: float = 1.0) -> None:
        """Decode straight into the bucket's own tensors, which must hold zeros (no buffer, no copy back).

        ``tensors`` concatenated end up equal, bit for bit, to ``decode`` of the same pairs. Served
        (:meth:`serves`): CPU tensors of fp32 or bf16 (``sparse_ops.can_decode_into``), or one contiguous tensor
        on any device in a dtype that sums in itself (not fp16); values are cast to their dtype.
        """
        tensors = list(tensors)
        check_indices(indices, sum(t.numel() for t in tensors))
        if sparse_ops.can_decode_into(tensors):
            sparse_ops.decode_into(tensors, indices, values, postscale)
            return
        flat = tensors[0].view(-1)  # decode's own steps, with the bucket's tensor as the buffer
        touched = []
        for idx, val in zip(indices, values):
            if idx.numel():
                idx = idx.to(device=flat.device)
                sparse_ops.add_(flat, idx, val)
                touched.append(idx)
        if touched and postscale != 1.0:
            pos = touched[0] if len(touched) == 1 else torch.cat(touched)
            sparse_ops.set_(flat, pos, sparse_ops.gather_scaled(flat, pos, postscale))

    @staticmethod
    def serves(tensors: Sequence[torch.Tensor]) -> bool:
        """Whether :meth:`decode_into` serves ``tensors``."""
        tensors = list(tensors)
        if sparse_ops.can_decode_into(tensors):
            return True
        return (len(tensors) == 1 and tensors[0].is_contiguous()
                and accumulation_dtype(tensors[0].dtype) == tensors[0].dtype)

    def reset(self) -> None:
        self._out.clear()
        self._acc.clear()
        self._touched.clear()
        self._version.clear()
