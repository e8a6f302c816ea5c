"""The identity of a gradient bucket across steps: the key of its residual, its seeds and its decisions.

DeepSpeed hands the hooks flat gradient buckets, not names. A bucket is known by where it comes in the
step's reduction round (its ordinal), its communication dtype, its length and a digest of its
parameters, so that one tensor's residual is never applied to another of the same size. The key is
saved with the residuals (``engine/state.py``), which read its fields by name.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

#: the hook point a key comes from
ALLREDUCE = "allreduce"  # ZeRO stage 0: DeepSpeedEngine.allreduce_bucket
REDUCE_SCATTER = "zero"  # ZeRO stage 1/2: DeepSpeedZeroOptimizer.average_tensor
ZERO3 = "zero3"  # ZeRO stage 3: DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads
OUTER = "outer"  # sync: local_steps: the pseudo-gradient of the fp32 master weights (engine/local_steps.py)
DENSE = "dense"  # ZeRO stage 0, advanced.dense_values: the raw gradient's quantized dense steps (their rounding)

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class BucketKey(NamedTuple):
    """A bucket's key (a tuple: hashable, picklable, ``repr``-stable across processes).

    Attributes:
        hook: :data:`ALLREDUCE` (ZeRO stage 0), :data:`REDUCE_SCATTER` (ZeRO stage 1/2), :data:`ZERO3`, :data:`OUTER`
            (the pseudo-gradient of ``sync: local_steps``) or :data:`DENSE` (the rounding of stage 0's quantized
            dense steps of the raw gradient, ``advanced.dense_values``).
        ordinal: the bucket's position within its reduction round (0-based).
        dtype: the communication dtype, as ``str(torch.dtype)`` (e.g. ``"torch.bfloat16"``).
        numel: the bucket's length in elements.
        layout: 16 hex digits, a digest of the bucket's parameters (names or ids, and shapes).
    """
    hook: str
    ordinal: int
    dtype: str
    numel: int
    layout: str

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        """The communication dtype, or None if it is not one the exchanges carry."""
        return _DTYPES.get(self.dtype)

    @classmethod
    def parse(cls, key: Any) -> Optional["BucketKey"]:
        """``key`` (a saved residual's key) as a :class:`BucketKey`, or None if it is not one: a 5-tuple of a known
        hook point and fields of the right types."""
        if not isinstance(key, tuple):
            return None
        if (len(key) == 5 and key[0] in (ALLREDUCE, REDUCE_SCATTER, ZERO3, OUTER, DENSE) and isinstance(key[1], int)
                and isinstance(key[2], str) and isinstance(key[3], int) and isinstance(key[4], str)):
            return cls(*key)
        return None


def bucket_seed(seed: int, step: int, ordinal: int) -> int:
    """Seed for (step, bucket): the same on every rank, different every step (paper: per-step hash seed)."""
    return (seed * 1_000_003 + step * 7919 + ordinal) & 0xFFFF_FFFF_FFFF


__all__ = ["ALLREDUCE", "BucketKey", "DENSE", "OUTER", "REDUCE_SCATTER", "ZERO3", "bucket_seed"]
