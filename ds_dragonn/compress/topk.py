"""Exact top-k of |g| — the quality reference and the slow baseline DRAGONN is measured against."""
from __future__ import annotations

import torch

from .base import Compressor, Selection, index_dtype, magnitude


class TopKCompressor(Compressor):
    """Keeps the ``k = ceil(density * numel)`` largest-magnitude elements (``torch.topk`` of |g|).

    Exact zeros are not sent (they carry nothing). Non-finite entries rank first (see ``magnitude``).
    """

    name = "topk"
    #: a buffer with NaN/±Inf always sends at least one of them (they rank first): the pipeline may skip
    #: its full non-finite pass when every sent value is finite (chunk-wise: see ``sends_non_finite``)
    finite_proof = True

    def _select(self, flat: torch.Tensor, k: int, seed: int) -> Selection:
        n = flat.numel()
        mag = magnitude(flat)
        top = torch.topk(mag, k, sorted=False)
        keep = top.values > 0
        idx = top.indices[keep]
        thr = top.values.min()
        return Selection(indices=idx.to(index_dtype(n)), values=flat[idx], threshold=thr.float(), k=k, capacity=k)
