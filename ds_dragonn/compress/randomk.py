"""Random-k: k uniformly chosen distinct elements — the cheapest selection, and a quality lower bound."""
from __future__ import annotations

import torch

from .base import Compressor, Selection, empty_selection, index_dtype, target_k


class RandomKCompressor(Compressor):
    """Keeps ``k = ceil(density * numel)`` distinct elements drawn uniformly from a private generator.

    Values are not rescaled by numel/k: with error feedback the residual carries the rest.
    """

    name = "randomk"

    def compress(self, flat: torch.Tensor, seed: int = 0) -> Selection:
        flat = self._check_input(flat)
        n = flat.numel()
        k = target_k(n, self.density)
        if k == 0:
            return empty_selection(flat)
        gen = self.private_generator(flat.device, seed)
        idx = torch.randperm(n, generator=gen, device=flat.device)[:k]
        idx, _ = torch.sort(idx)
        return Selection(indices=idx.to(index_dtype(n)), values=flat[idx],
                         threshold=torch.zeros((), dtype=torch.float32, device=flat.device), k=k, capacity=k)
