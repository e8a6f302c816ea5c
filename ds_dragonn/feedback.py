"""Error feedback: a residual per flattened buffer, so that nothing selected away is lost, only delayed.

Order (fixed in ``ds_dragonn.pipeline`` and nowhere else, cf. GRACE's communicator template):
``compensate`` (buffer + residual) → compress → exchange → ``update`` (residual = compensated − sent),
the update only after the exchange succeeded.

Invariant, exactly (tests check it): ``scatter(sent) + residual == compensated``. Residuals of
fp16/bf16 buffers are kept in float32 so that small entries are not rounded away; what was actually
sent (in the wire dtype) is subtracted, so the rounding of sent values stays in the residual too.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional

import torch


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp16/bf16 buffers, the buffer's own dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class ErrorFeedback:
    """Residuals keyed by a stable bucket key (e.g. ``(ordinal, dtype, numel)``).

    Args:
        enabled: when False, ``compensate`` returns the buffer unchanged and ``update`` keeps nothing.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.residuals: Dict[Hashable, torch.Tensor] = {}

    def compensate(self, key: Hashable, flat: torch.Tensor) -> torch.Tensor:
        """Return a new (n,) tensor ``flat + residual`` in :func:`residual_dtype` (residual 0 if none)."""
        out = flat.to(residual_dtype(flat.dtype), copy=True)
        if not self.enabled:
            return out
        res = self.residuals.get(key)
        if res is not None:
            if res.shape != out.shape or res.device != out.device:
                raise ValueError(f"residual for bucket {key} has shape {tuple(res.shape)} on {res.device}, "
                                 f"buffer has {tuple(out.shape)} on {out.device}")
            out.add_(res)
        return out

    def update(self, key: Hashable, compensated: torch.Tensor, indices: torch.Tensor,
               sent_values: torch.Tensor) -> Optional[torch.Tensor]:
        """Store ``residual = compensated − scatter(indices, sent_values)``; takes ownership of ``compensated``.

        Entries that are not finite are reset to 0: a NaN/Inf was sent (see ``compress.base.magnitude``)
        and must not poison every later step.

        Returns the residual (None when error feedback is off).
        """
        if not self.enabled:
            return None
        res = compensated
        idx = indices.long()
        res[idx] = res[idx] - sent_values.to(res.dtype)
        res.masked_fill_(~torch.isfinite(res), 0.0)
        self.residuals[key] = res
        return res

    def reset(self) -> None:
        self.residuals.clear()

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "residuals": {k: v.detach().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore residuals (the ``enabled`` switch stays as configured)."""
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
