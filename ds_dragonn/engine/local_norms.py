"""Gradient clipping and the overflow check without a collective between syncs (``sync: local_steps``).

DeepSpeed 0.19.8 clips fp32 gradients by the ranks' common norm (``runtime/utils.py`` ``clip_grad_norm_``
allreduces it over the data-parallel group, every step, with ``gradient_clipping`` 1.0 by default), and its
fp16 optimizer checks overflow over every rank (``CheckOverflow.has_overflow``: an allreduce over the world
group). Between syncs each rank trains alone, so each uses its own norm and its own overflow: a local step
then issues no collective (``tests/test_local_steps.py`` counts them), and a dead rank is found at the outer
step, not in a per-step round trip on the slow link.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def install_local_norms(engine: Any, local: Callable[[], bool]) -> None:
    """Wrap ``engine.clip_fp32_gradients`` and the fp16/bf16 optimizer's ``overflow_checker.has_overflow`` on the
    instance: DeepSpeed's own where ``local()`` is False (the dense warm-up), each rank's own otherwise."""
    dense_clip = engine.clip_fp32_gradients

    def clip_fp32_gradients():
        if not local():
            return dense_clip()
        params = [p for p in engine.module.parameters() if p.grad is not None]
        if params:  # torch's clipping: this rank's own norm
            torch.nn.utils.clip_grad_norm_(params, max_norm=engine.gradient_clipping())
    engine.clip_fp32_gradients = clip_fp32_gradients
    checker = getattr(engine.optimizer, "overflow_checker", None)
    if checker is not None and callable(getattr(checker, "has_overflow_serial", None)):
        dense_check = checker.has_overflow

        def has_overflow(params, *args, **kwargs):
            return checker.has_overflow_serial(params) if local() else dense_check(params, *args, **kwargs)
        checker.has_overflow = has_overflow


__all__ = ["install_local_norms"]
