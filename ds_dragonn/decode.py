"""Decode: sum every rank's (index, value) pairs into one dense buffer, then average.

Fixes the prototype's overwrite-scatter: pairs from different ranks that hit the same index are
*summed* (``index_add_``), and the sum is scaled afterwards exactly as DeepSpeed's dense path scales its
allreduced sum. Ranks are added one after another: within a rank indices are distinct, so even the GPU's
atomic ``index_add_`` is deterministic and every rank decodes bit-identical results.

Step budget: :class:`SparseDecoder` keeps one persistent output buffer per bucket that is zero except at
the positions the previous step decoded; it clears those (``P × k`` positions) instead of zeroing the
whole buffer, and scales only the decoded positions. A step therefore costs O(P·k), not O(n), unless
somebody wrote into the returned buffer (its ``_version`` changed): then it is zeroed in full once.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Sequence

import torch

from . import scatter
from .compress.kernels import cpu_table
from .memory import persistent_zeros


def decode_sum(numel: int, indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Dense sum of sparse contributions in a new buffer (reference; :class:`SparseDecoder` is the fast path).

    Args:
        numel: length n of the dense buffer.
        indices: per rank, (c_r,) int32/int64 distinct positions in [0, n).
        values: per rank, (c_r,) values (any float dtype; cast to ``dtype``).
        dtype, device: of the result.
    Returns:
        (n,) tensor: ``out[i] = sum over ranks r and j with indices[r][j] == i of values[r][j]``.
    """
    out = torch.zeros(numel, dtype=dtype, device=device)
    for idx, val in zip(indices, values):
        if idx.numel():
            out.index_add_(0, idx.to(device=device, dtype=torch.long), val.to(device=device, dtype=dtype))
    return out


def check_indices(indices: Sequence[torch.Tensor], numel: int) -> None:
    """Raise ValueError when a rank's indices fall outside [0, numel) (a corrupt or mismatched peer): the
    fast paths write through raw addresses, so this must hold before any write. One min/max per rank."""
    for r, idx in enumerate(indices):
        if idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= numel:
                raise ValueError(f"rank {r} sent indices in [{lo}, {hi}], outside the bucket's [0, {numel}): "
                                 f"a corrupt exchange, or ranks reducing different buckets")


class SparseDecoder:
    """Persistent per-bucket decode buffers, cleared and scaled sparsely."""

    def __init__(self):
        self._out: Dict[Hashable, torch.Tensor] = {}
        self._touched: Dict[Hashable, List[torch.Tensor]] = {}  # positions the last decode wrote
        self._version: Dict[Hashable, int] = {}  # the buffer's _version right after that decode

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
                scatter.zero_(out, idx)
        touched = []
        for idx, val in zip(indices, values):
            if idx.numel():
                idx = idx.to(device=device)
                scatter.add_(out, idx, val)
                touched.append(idx)
        if postscale != 1.0 and touched:
            # read every decoded sum before writing any: an index sent by several ranks is then
            # written several times with the same value
            pos = touched[0] if len(touched) == 1 else torch.cat(touched)
            scatter.set_(out, pos, scatter.gather_scaled(out, pos, postscale))
        self._touched[key] = touched
        self._version[key] = out._version
        return out

    @staticmethod
    def decode_into(tensors: Sequence[torch.Tensor], indices: Sequence[torch.Tensor],
                    values: Sequence[torch.Tensor], postscale: float = 1.0) -> None:
        """Decode straight into the bucket's own tensors, which must hold zeros (no buffer, no copy back).

        ``tensors`` concatenated end up equal, bit for bit, to ``decode`` of the same pairs. CPU tensors of
        fp32 or bf16 only (``cpu_table.segments_supported``); values are cast to their dtype.
        """
        tensors = list(tensors)
        check_indices(indices, sum(t.numel() for t in tensors))
        dtype = tensors[0].dtype
        addrs = []
        for idx, val in zip(indices, values):
            if idx.numel():
                a = cpu_table.segment_addresses(tensors, idx)
                cpu_table.addr_update(dtype, a, "add", val.to(dtype))
                addrs.append(a)
        if postscale != 1.0 and addrs:
            a = addrs[0] if len(addrs) == 1 else torch.cat(addrs)
            cpu_table.addr_update(dtype, a, "set", cpu_table.addr_update(dtype, a, "gather_scaled", scale=postscale))

    def reset(self) -> None:
        self._out.clear()
        self._touched.clear()
        self._version.clear()
