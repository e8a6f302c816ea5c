"""The selection baselines DRAGONN is measured against, outside the package: exact top-k of |g| (the quality
reference and the slow baseline) and random-k (the cheapest selection, a quality lower bound).

Both are :class:`ds_dragonn.compress.base.Compressor` subclasses: a benchmark or a test hands one to
``ds_dragonn.pipeline.CompressedAllreduce`` (or an exchange) directly; the ``"dragonn"`` config block selects
DRAGONN only.
"""
from __future__ import annotations

import torch

from ds_dragonn.compress.base import Compressor, Selection, index_dtype, magnitude


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


class RandomKCompressor(Compressor):
    """Keeps ``k = ceil(density * numel)`` distinct elements drawn uniformly from a private generator.

    Values are not rescaled by numel/k: with error feedback the residual carries the rest.
    """

    name = "randomk"

    def _select(self, flat: torch.Tensor, k: int, seed: int) -> Selection:
        n = flat.numel()
        gen = self.private_generator(flat.device, seed)
        idx = torch.empty(0, dtype=torch.int64, device=flat.device)
        if 4 * k <= n:  # O(k log k): oversample with replacement, drop duplicates, keep a random k of them
            draw = torch.randint(0, n, (k + k // 4 + 16,), generator=gen, device=flat.device).unique()
            if draw.numel() >= k:
                keep = torch.randperm(draw.numel(), generator=gen, device=flat.device)[:k]
                idx = draw[keep]
        if idx.numel() < k:  # dense regime (or unlucky draw): a permutation of all n
            idx = torch.randperm(n, generator=gen, device=flat.device)[:k]
        idx, _ = torch.sort(idx)
        return Selection(indices=idx.to(index_dtype(n)), values=flat[idx],
                         threshold=torch.zeros((), dtype=torch.float32, device=flat.device), k=k, capacity=k)


__all__ = ["RandomKCompressor", "TopKCompressor"]
