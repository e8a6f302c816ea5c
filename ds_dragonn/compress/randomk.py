"""Random-k: k uniformly chosen distinct elements — the cheapest selection, and a quality lower bound."""
from __future__ import annotations

import torch

from .base import Compressor, Selection, index_dtype


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
