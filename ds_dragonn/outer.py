"""The outer step of local-step training: ``θ_outer`` and the outer SGD (DiLoCo's outer optimizer).

Every rank runs H optimizer steps from the shared ``θ_outer``; the round's pseudo-gradient ``Δ = θ_outer − θ_local``,
averaged over the ranks, is applied by a plain outer SGD step ``θ_outer ← θ_outer − lr·Δ̄`` (DiLoCo, Douillard et
al., 2023, without its outer Nesterov momentum, as SparseLoCo, 2025). The compression (``ds_dragonn.pipeline``) runs
between :meth:`OuterStep.pseudo_gradient` and :meth:`OuterStep.apply_`. Everything is fp32. See docs/design.md,
'Local steps: ``"sync": "local_steps"``'.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Union

import torch


class OuterStep:
    """``θ_outer`` (the anchor every rank restarts from) and the plain outer SGD step.

    Args:
        lr: outer learning rate (> 0).
    Raises:
        ValueError: ``lr`` not > 0.
    """

    def __init__(self, lr: float = 1.0):
        if not lr > 0.0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        self.lr = float(lr)
        self.anchor: Optional[List[torch.Tensor]] = None  # θ_outer, fp32, one tensor per master tensor
        self.rounds = 0  # outer steps applied

    @property
    def started(self) -> bool:
        return self.anchor is not None

    def start(self, masters: Sequence[torch.Tensor]) -> None:
        """``θ_outer ← masters`` (fp32 copies): the first round starts here (equal on every rank)."""
        self.anchor = [m.detach().to(torch.float32, copy=True) for m in masters]

    def pseudo_gradient(self, masters: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """``Δ = θ_outer − θ_local`` per master tensor: new fp32 tensors of the masters' shapes.

        Raises:
            RuntimeError: :meth:`start` was not called.
            ValueError: the masters do not match the anchor (count or shapes).
        """
        anchor = self._anchor_for(masters)
        return [a - m.detach().float() for a, m in zip(anchor, masters)]

    @torch.no_grad()
    def apply_(self, averaged: Sequence[torch.Tensor]) -> None:
        """``θ_outer ← θ_outer − lr·Δ̄`` with the ranks' averaged pseudo-gradient ``Δ̄`` (shapes of the anchor; any
        float dtype)."""
        for a, d in zip(self._anchor_for(averaged), averaged):
            a.sub_(d.to(torch.float32), alpha=self.lr)
        self.rounds += 1

    @torch.no_grad()
    def restart_(self, masters: Sequence[torch.Tensor]) -> None:
        """``masters ← θ_outer`` in place (every rank starts the next round from the same weights)."""
        for a, m in zip(self._anchor_for(masters), masters):
            m.copy_(a)

    def _anchor_for(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        if self.anchor is None:
            raise RuntimeError("the outer step has no θ_outer yet (start() was not called)")
        if len(tensors) != len(self.anchor) or any(t.shape != a.shape for t, a in zip(tensors, self.anchor)):
            raise ValueError(f"{len(tensors)} tensors of shapes {[tuple(t.shape) for t in tensors][:4]} do not match "
                             f"θ_outer's {len(self.anchor)} of {[tuple(a.shape) for a in self.anchor][:4]}")
        return self.anchor

    def state_dict(self) -> dict:
        """``{"anchor", "rounds", "lr"}`` (tensors cloned; None before :meth:`start`)."""
        anchor = None if self.anchor is None else [t.detach().clone() for t in self.anchor]
        return {"anchor": anchor, "rounds": self.rounds, "lr": self.lr}

    def load_state_dict(self, state: dict, masters: Sequence[torch.Tensor]) -> None:
        """Restore :meth:`state_dict` for ``masters`` (their devices).

        Raises:
            ValueError: the saved anchor does not match the masters (count, shapes), or is not finite.
        """
        anchor = state.get("anchor")
        if anchor is None:
            self.anchor, self.rounds = None, int(state.get("rounds", 0))
            return
        self._check(anchor, masters, "θ_outer")
        self.anchor = [a.to(device=m.device, dtype=torch.float32).clone() for a, m in zip(anchor, masters)]
        self.rounds = int(state.get("rounds", 0))

    @staticmethod
    def _check(saved, masters, what: str) -> None:
        if not isinstance(saved, (list, tuple)) or len(saved) != len(masters) or any(
                not isinstance(s, torch.Tensor) or s.shape != m.shape for s, m in zip(saved, masters)):
            raise ValueError(f"saved {what} does not match the master weights ({len(masters)} tensors)")
        if any(s.numel() and not bool(torch.isfinite(s).all()) for s in saved):
            raise ValueError(f"saved {what} holds NaN or Inf")


#: ``outer_lr: "auto"`` for a compressed Δ (density < 1) is at least this (docs/results.md, "A compressed Δ at
#: density 0.1").
COMPRESSED_MIN_OUTER_LR = 2.0


def outer_lr_for(setting: Union[str, float], workers: int, density: float = 1.0) -> float:
    """The outer learning rate of an ``outer_lr`` setting: a number as given; ``"auto"``: √(workers), and at
    least :data:`COMPRESSED_MIN_OUTER_LR` where the Δ is compressed (``density`` < 1).

    √W undoes most of the shrinking of the consensus step that averaging W workers' Adam steps causes (docs/results.md,
    "Where local steps lose steps"); a sparse Δ takes a larger step still.

    Raises:
        ValueError: ``workers`` < 1, or a setting that is neither ``"auto"`` nor a number > 0.
    """
    if workers < 1:
        raise ValueError(f"outer_lr 'auto' needs at least one worker, got {workers}")
    lr = auto_outer_lr(workers, density) if setting == "auto" else setting
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0.0:
        raise ValueError(f"outer_lr must be a number > 0 or \"auto\", got {setting!r}")
    return float(lr)


def auto_outer_lr(workers: int, density: float) -> float:
    """``outer_lr: "auto"``: √(workers), at least :data:`COMPRESSED_MIN_OUTER_LR` for ``density`` < 1."""
    root = math.sqrt(workers)
    return root if density >= 1.0 else max(COMPRESSED_MIN_OUTER_LR, root)


__all__ = ["COMPRESSED_MIN_OUTER_LR", "OuterStep", "auto_outer_lr", "outer_lr_for"]
