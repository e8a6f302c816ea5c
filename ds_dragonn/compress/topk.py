"""Exact top-k of |g| — the quality reference and the slow baseline DRAGONN is measured against."""
from __future__ import annotations

import torch

from .base import Compressor, Selection, empty_selection, index_dtype, magnitude, target_k


class TopKCompressor(Compressor):
    """Keeps the ``k = ceil(density * numel)`` largest-magnitude elements (``torch.topk`` of |g|).

    Exact zeros are not sent (they carry nothing). Non-finite entries rank first (see ``magnitude``).
    """

    name = "topk"

    def compress(self, flat: torch.Tensor, seed: int = 0) -> Selection:
        flat = self._check_input(flat)
        n = flat.numel()
        k = target_k(n, self.density)
        if k == 0:
            return empty_selection(flat)
        mag = magnitude(flat)
        top = torch.topk(mag, k, sorted=False)
        keep = top.values > 0
        idx = top.indices[keep]
        thr = top.values.min()
        return Selection(indices=idx.to(index_dtype(n)), values=flat[idx], threshold=thr.float(), k=k, capacity=k)
