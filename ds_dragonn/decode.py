"""Decode: sum every rank's (index, value) pairs into one dense buffer.

Fixes the prototype's overwrite-scatter: pairs from different ranks that hit the same index are
*summed* (``index_add_``), and averaging is left to the caller so it matches DeepSpeed's dense path.
Ranks are added one after another: within a rank indices are distinct, so even the GPU's atomic
``index_add_`` is deterministic and every rank decodes bit-identical results.
"""
from __future__ import annotations

from typing import Sequence

import torch


def decode_sum(numel: int, indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Dense sum of sparse contributions.

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
