"""``sync: local_steps``: each rank's fp32 master weights, and the pseudo-gradient they hold back.

Below density 1.0 with error feedback (error reset, CSER: Xie et al., NeurIPS 2020) a rank's masters hold
``θ_outer − e`` after a compressed round, ``e`` the rank's outer residual; these helpers keep that bookkeeping out
of :class:`~ds_dragonn.engine.local_steps.LocalStepsHook`.
"""
from __future__ import annotations

import hashlib
from typing import Any, List, Optional

import torch

from ..feedback import segment_views


def masters_of(optimizer: Any) -> List[torch.Tensor]:
    """The fp32 master weights ``optimizer`` (the innermost torch optimizer) steps on, in its parameter order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


@torch.no_grad()
def masters_to_model(engine: Any) -> None:
    """Copy the masters into the low-precision weights where they are separate: ``FP16_Optimizer`` (flat fp32
    groups) or ``FP16_UnfusedOptimizer`` (one fp32 tensor per weight), in bf16 and fp16; nothing in fp32, where
    the masters are the model's weights."""
    wrapper = engine.optimizer
    lows = getattr(wrapper, "fp16_groups", None)
    if lows is None:
        return
    flats = getattr(wrapper, "fp32_groups_flat", None)
    if flats is not None:
        from torch._utils import _unflatten_dense_tensors
        highs = [_unflatten_dense_tensors(flat, group) for flat, group in zip(flats, lows)]
    else:
        highs = wrapper.fp32_groups
    for low, high in zip(lows, highs):
        for p, q in zip(low, high):
            p.data.copy_(q.data)


@torch.no_grad()
def from_rank0_(tensor: torch.Tensor, backend: Any) -> None:
    """``tensor`` ← rank 0's, bit-exactly, on every rank: one allreduce of rank 0's values and the other ranks' zeros
    (x + 0 = x); nothing at world size 1. Collective."""
    if backend.world_size > 1:
        if backend.rank != 0:
            tensor.zero_()
        backend.all_reduce_sum_(tensor)


@torch.no_grad()
def copy_rank0_(masters: List[torch.Tensor], backend: Any) -> bool:
    """Every rank's ``masters`` ← rank 0's (:func:`from_rank0_`). Returns whether anything was exchanged (False at
    world size 1)."""
    if backend.world_size <= 1:
        return False
    flat = torch.cat([m.detach().reshape(-1) for m in masters])
    from_rank0_(flat, backend)
    for m, w in zip(masters, segment_views(flat, masters)):
        m.copy_(w)
    return True


def holds_in_weights(cfg: Any, error_feedback_enabled: bool) -> bool:
    """Whether a round leaves its unsent Δ in the weights: below density 1.0 with error feedback (a dense round leaves only the wire's rounding, which stays in the residual so that every rank holds
    θ_outer)."""
    return cfg.density < 1.0 and error_feedback_enabled


def kept_in_weights(pipeline: Any, key: Any, numel: int, device: Any, topology: Any) -> Optional[torch.Tensor]:
    """What this rank's (node's) weights hold back of the pseudo-gradient: the outer residual, (numel,) float32,
    per worker (``topology.per_worker``: node-aware, divided by the L ranks of a node whose sum it holds); None
    before the first compressed round."""
    held = pipeline.residual_of(key, numel, device)
    return None if held is None else topology.per_worker(held)


@torch.no_grad()
def subtract_(tensors: List[torch.Tensor], flat: Optional[torch.Tensor]) -> None:
    """``tensors −= flat``, ``flat`` (Σ numel,) laid out over them in order; nothing when ``flat`` is None."""
    if flat is not None:
        for t, r in zip(tensors, segment_views(flat, tensors)):
            t.sub_(r)


def shapes_digest(masters: List[torch.Tensor]) -> str:
    """A short digest of the masters' shapes: part of the outer bucket's key (another model, another residual)."""
    return hashlib.blake2b(repr([tuple(m.shape) for m in masters]).encode(), digest_size=8).hexdigest()


__all__ = ["copy_rank0_", "from_rank0_", "holds_in_weights", "kept_in_weights", "masters_of", "masters_to_model", "shapes_digest",
           "subtract_"]
