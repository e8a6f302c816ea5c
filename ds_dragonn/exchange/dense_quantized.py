"""A dense allreduce whose values travel quantized: the dense steps' exchange under ``advanced.dense_values``.

Two phases over ``P`` ranks (ZeRO++ qgZ: Wang et al. 2023, "ZeRO++", quantized gradients by all-to-all; here
with error feedback instead of qgZ's two-level hierarchy):

1. reduce-scatter: the buffer is cut into ``P`` contiguous shards (:func:`shard_bounds`); each rank quantizes
   shard ``j`` (int8 / int4 codes, one float32 scale per 64 values: ``exchange/quantize.py``) and sends it to
   rank ``j`` (one all-to-all); the owner decodes the ``P`` shards and sums them in rank order (float32);
2. allgather: each owner quantizes its summed shard and every rank gathers and decodes all ``P`` of them.

Every rank decodes the same codes with the same operations (bit-identical results); the rounding of both phases
is handed back for the residual. Bytes: see docs/design.md, 'Quantized dense steps'.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Tuple

import torch


class QuantizedReduction(NamedTuple):
    """One quantized dense allreduce on this rank.

    Attributes:
        out: (n,) float32, ``Σ_ranks`` of the decoded contributions (decoded again after the owners'
            re-quantization): the same bits on every rank.
        sent: (n,) float32, this rank's contribution as the owners decoded it (``x − sent``: its rounding).
        owned: ``(start, end)`` of the shard this rank owns.
        owner_rounding: (end − start,) float32, the owner's rounding of its summed shard (``sum − decoded``).
        bytes_sent: bytes this rank put on the wire (:func:`quantized_allreduce_bytes`).
    """
    out: torch.Tensor
    sent: torch.Tensor
    owned: Tuple[int, int]
    owner_rounding: torch.Tensor
    bytes_sent: int


def shard_bounds(numel: int, world: int) -> List[Tuple[int, int]]:
    """``world`` contiguous shards covering ``[0, numel)``: the first ``numel mod world`` one element longer
    (some empty when ``numel < world``)."""
    base, extra = divmod(int(numel), int(world))
    bounds, start = [], 0
    for r in range(world):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def quantized_allreduce_bytes(numel: int, world: int, codec: Any) -> int:
    """Bytes each rank sends in :func:`quantized_allreduce` of ``numel`` elements over ``world`` ranks (the
    largest shard's, so every rank's model is the same upper bound); 0 at world size 1."""
    if world <= 1:
        return 0
    longest = max(e - s for s, e in shard_bounds(numel, world))
    return 2 * (world - 1) * codec.block_bytes(longest, torch.float32)


@torch.no_grad()
def quantized_allreduce(x: torch.Tensor, backend, codec: Any) -> QuantizedReduction:
    """Sum ``x`` over the ranks of ``backend`` with its values quantized by ``codec`` (module docstring).

    Args:
        x: (n,) float32 or float64, this rank's contribution (residual + gradient); not modified. Same ``n``
            on every rank.
        backend: a :class:`~ds_dragonn.comm.base.CommBackend` (``all_to_all_bytes``, ``all_gather_bytes``).
        codec: a :class:`~ds_dragonn.exchange.quantize.QuantizedCodec` (int8 or int4).
    Returns:
        :class:`QuantizedReduction`. A non-finite value decodes its whole group of 64 to NaN (the overflow
        check downstream sees it, as with the dense allreduce).
    Raises:
        CommError: a collective failed.
    """
    world, rank = backend.world_size, backend.rank
    v = x.reshape(-1).float()
    n = v.numel()
    bounds = shard_bounds(n, world)
    s0, e0 = bounds[rank]
    if world == 1:  # nothing travels; the rounding is what a peer would have decoded
        return QuantizedReduction(v.clone(), v.clone(), (0, n), torch.zeros(0, device=v.device), 0)

    # phase 1: this rank's shard j, quantized, to owner j
    sizes = [codec.block_bytes(e - s, torch.float32) for s, e in bounds]
    payload = torch.zeros(sum(sizes), dtype=torch.uint8, device=v.device)
    sent = torch.empty_like(v)
    at = 0
    for (s, e), size in zip(bounds, sizes):
        sent[s:e] = codec.write(payload[at:at + size], v[s:e], e - s)
        at += size
    mine = sizes[rank]
    received = backend.all_to_all_bytes(payload, sizes, [mine] * world)
    total = torch.zeros(e0 - s0, dtype=torch.float32, device=v.device)
    for r in range(world):  # rank order: the same sum on whichever rank owns the shard
        total += codec.read(received[r * mine:(r + 1) * mine], e0 - s0, e0 - s0, torch.float32)

    # phase 2: each owner's summed shard, quantized, to every rank (equal block sizes for the allgather)
    longest = max(e - s for s, e in bounds)
    size = codec.block_bytes(longest, torch.float32)
    block = torch.zeros(size, dtype=torch.uint8, device=v.device)
    decoded = codec.write(block, total, longest)
    gathered = backend.all_gather_bytes(block)
    out = torch.empty_like(v)
    for r, (s, e) in enumerate(bounds):
        out[s:e] = codec.read(gathered[r], e - s, longest, torch.float32)
    sent_bytes = sum(sz for j, sz in enumerate(sizes) if j != rank) + (world - 1) * size
    return QuantizedReduction(out, sent, (s0, e0), total - decoded, sent_bytes)


__all__ = ["QuantizedReduction", "quantized_allreduce", "quantized_allreduce_bytes", "shard_bounds"]
