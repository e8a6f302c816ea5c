"""Per-tensor selection inside a flattened bucket: where each parameter's gradient lies, and which are sent whole.

DeepSpeed flattens many parameters into one bucket (ZeRO-0 flattens the whole model). One global threshold
over such a bucket starves the parameters whose gradients are small in absolute terms (LayerNorm and bias
gradients are often 10-100x smaller than a weight matrix's). The DRAGONN paper selects per tensor and
sends small tensors dense ("efficiency-aware tensor selection", Wang et al., ICML 2022, Sec. 4); PowerSGD
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``) leaves 1-D tensors uncompressed.

A :class:`Segments` lists the parameters' offsets in the bucket. Each segment gets its own
``k_s = ceil(density · n_s)`` and its own threshold and hash table (``Compressor.compress(flat, seed,
segments)``); a segment marked ``whole`` is sent dense inside the same exchange: every element, after the
selected pairs (``Selection.whole``). The allgather exchange sends their values only (every rank knows the
positions); the partitioned and reduce-scatter exchanges send them as pairs. Either way their bytes are
counted like any others.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple

from .base import target_k


class Segments(NamedTuple):
    """Parameter boundaries of a flattened bucket.

    Attributes:
        offsets: (nseg + 1,) ascending element offsets; ``offsets[0] == 0``, ``offsets[-1] == numel``.
            Segment s is ``[offsets[s], offsets[s+1])`` (may be empty).
        whole: (nseg,) True where the segment is sent whole (every element).
    """
    offsets: Tuple[int, ...]
    whole: Tuple[bool, ...]

    @classmethod
    def of(cls, offsets, whole) -> "Segments":
        """From any sequences (tuples are needed: segments key caches)."""
        return cls(tuple(int(o) for o in offsets), tuple(bool(w) for w in whole))

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def lengths(self) -> Tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.offsets[:-1], self.offsets[1:]))

    def ks(self, density: float) -> Tuple[int, ...]:
        """Per-segment target ``k_s``: ``n_s`` for a whole segment, else ``ceil(density · n_s)`` (0 when empty)."""
        return tuple(n if w else target_k(n, density) for n, w in zip(self.lengths(), self.whole))

    def describe(self) -> str:
        """One line for the logs: segments, how many are sent whole and their share of the elements."""
        lens = self.lengths()
        whole = sum(n for n, w in zip(lens, self.whole) if w)
        return (f"{len(lens)} tensors, {sum(self.whole)} sent whole "
                f"({whole} elements, {100.0 * whole / max(self.numel, 1):.2f} %)")


def plan_segments(shapes: Sequence[Sequence[int]], min_numel: int = 0, compress_1d: bool = True) -> Segments:
    """The segments of a bucket made of tensors of ``shapes``, in order.

    Args:
        shapes: each tensor's shape (``torch.Size`` or tuple); the bucket is their concatenation.
        min_numel: tensors with fewer elements are sent whole.
        compress_1d: False sends every tensor of fewer than two dimensions whole (biases, norm weights).
    Returns:
        :class:`Segments` with one segment per tensor.
    """
    offsets, whole, off = [0], [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            if int(d) < 0:
                raise ValueError(f"negative dimension in tensor shape {tuple(shape)}")
            n *= int(d)
        off += n
        offsets.append(off)
        whole.append(n < min_numel or (not compress_1d and len(shape) < 2))
    return Segments(tuple(offsets), tuple(whole))
