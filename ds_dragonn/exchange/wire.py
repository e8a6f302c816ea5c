"""What goes on the wire, and what it costs: value dtype codes, block alignment, the clamp to a 16-bit wire
dtype, bucket digests, and every byte model (dense ring collectives, sparse headers and blocks).

One home for these numbers (exchanges, engine, telemetry, ``launch/`` benchmarks). Byte models are per rank,
sent bytes, ring algorithms.
"""
from __future__ import annotations

import hashlib
from typing import Hashable, Optional

import torch

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
ALIGN = 8  # every block of a payload starts on 8 bytes: zero-copy views of any dtype


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def to_wire(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in the wire dtype; finite values beyond its range are clamped to its largest finite value.

    A float32 residual can exceed fp16's 65504 although no gradient does; clamped, the excess stays in the
    residual instead of poisoning the result as Inf. Non-finite values are sent as they are.
    """
    if dtype not in (torch.float16, torch.bfloat16) or values.dtype == dtype:
        return values.to(dtype)
    big = torch.finfo(dtype).max
    return torch.where(torch.isfinite(values), values.clamp(-big, big), values).to(dtype)


def dense_allreduce_bytes(numel: int, itemsize: int, world_size: int) -> int:
    """Bytes each rank sends in a ring allreduce of ``numel`` elements: ``2(P-1)/P × numel × itemsize``."""
    return int(2 * (world_size - 1) * numel * itemsize // max(world_size, 1))

def dense_reduce_scatter_bytes(numel: int, itemsize: int, world_size: int) -> int:
    """Bytes each rank sends in a ring reduce-scatter of ``numel`` elements: ``(P-1)/P × numel × itemsize``."""
    return int((world_size - 1) * numel * itemsize // max(world_size, 1))


def counts_header_bytes(world: int) -> int:
    """Bytes each rank sends in the counts-header allgather of a sparse reduce-scatter (ring model):
    ``[counts to each rank, numel, dtype code, finite]``."""
    return (world - 1) * (world + 3) * 8


def block_bytes(count: int, idx_dtype: torch.dtype, wire_dtype: torch.dtype) -> int:
    """Bytes of one block of ``count`` (index, value) pairs: each array aligned to :data:`ALIGN`."""
    return align(count * idx_dtype.itemsize) + align(count * wire_dtype.itemsize)


#: Positions travel packed: 16-bit offsets inside chunks of ``2^CHUNK_BITS`` elements after one int32 count per
#: chunk, where that is smaller than plain int32/int64 (:func:`packs`; docs/design.md, 'The data path of one bucket').
CHUNK_BITS = 16
_OFFSET_BIAS = 1 << (CHUNK_BITS - 1)  # offsets in [0, 2^16) stored as int16 offset − 2^15 (lossless)


def num_chunks(numel: int) -> int:
    """Chunks of ``2^CHUNK_BITS`` elements covering a buffer of ``numel`` (at least 1)."""
    return max(1, -(-int(numel) // (1 << CHUNK_BITS)))


def chunk_counts_bytes(numel: int) -> int:
    """Bytes of a packed block's per-chunk counts (int32, aligned): 0 for a single-chunk buffer."""
    chunks = num_chunks(numel)
    return align(4 * chunks) if chunks > 1 else 0


def index_bytes(count: int, numel: int) -> int:
    """Bytes of ``count`` packed positions of a ``numel``-element buffer (:func:`pack_indices`), aligned."""
    return chunk_counts_bytes(numel) + align(2 * int(count))


def packs(capacity: int, numel: int, idx_dtype: torch.dtype) -> bool:
    """Whether a block with room for ``capacity`` positions travels packed (strictly fewer bytes than plain)."""
    return index_bytes(capacity, numel) < align(int(capacity) * idx_dtype.itemsize)


def index_block_bytes(capacity: int, numel: int, idx_dtype: torch.dtype) -> int:
    """Bytes of a block with room for ``capacity`` positions: packed or plain ``idx_dtype``, the smaller."""
    return index_bytes(capacity, numel) if packs(capacity, numel, idx_dtype) else align(int(capacity) * idx_dtype.itemsize)


def pair_block_bytes(count: int, numel: int, idx_dtype: torch.dtype, wire_dtype: torch.dtype, codec) -> int:
    """Bytes of one block of ``count`` (position, value) pairs as :func:`write_indices` lays it out: the
    positions (packed or plain, :func:`index_block_bytes`) then the values, each aligned; 0 for no pairs.
    ``codec``: the :class:`~ds_dragonn.exchange.quantize.ValueCodec` sizing the values."""
    if not count:
        return 0
    return index_block_bytes(count, numel, idx_dtype) + codec.block_bytes(count, wire_dtype)


def pack_indices(indices: torch.Tensor, numel: int) -> tuple:
    """Sort distinct positions and split them into 16-bit chunk offsets and per-chunk counts.

    Args:
        indices: (c,) int32/int64 distinct positions in [0, numel).
        numel: the buffer's length (the same on every rank: it fixes the chunk grid).
    Returns:
        ``(order, offsets, chunk_counts)``: (c,) int64 permutation that sorts ``indices`` (apply it to the
        values), (c,) int16 offsets ``(index mod 2^16) − 2^15`` in sorted order, and
        (:func:`num_chunks`,) int32 pairs per chunk (None for a single-chunk buffer).
    """
    ordered, order = torch.sort(indices.long())
    offsets = ((ordered & ((1 << CHUNK_BITS) - 1)) - _OFFSET_BIAS).to(torch.int16)
    chunks = num_chunks(numel)
    if chunks == 1:
        return order, offsets, None
    # chunk edges in the sorted positions: no device sync on CUDA (bincount would read the max)
    edges = torch.arange(chunks + 1, dtype=torch.int64, device=indices.device) << CHUNK_BITS
    counts = torch.searchsorted(ordered, edges).diff().to(torch.int32)
    return order, offsets, counts


def unpack_indices(offsets: torch.Tensor, chunk_counts, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_indices`: (c,) positions in ``dtype`` (int32/int64), in sorted order.

    Args:
        offsets: (c,) int16 offsets from :func:`pack_indices`.
        chunk_counts: (:func:`num_chunks`,) int32 counts, or None for a single-chunk buffer.
        numel: the buffer's length.
        dtype: the index dtype to return (:func:`ds_dragonn.compress.base.index_dtype`).
    """
    idx = offsets.to(dtype) + _OFFSET_BIAS
    if chunk_counts is None or not offsets.numel():
        return idx
    starts = torch.arange(chunk_counts.numel(), dtype=dtype, device=offsets.device) << CHUNK_BITS
    # output_size: no device sync to learn the length on CUDA
    return idx + torch.repeat_interleave(starts, chunk_counts.long(), output_size=offsets.numel())


def write_indices(block: torch.Tensor, indices: torch.Tensor, capacity: int, numel: int,
                  idx_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Write ``indices`` into ``block`` (uint8, :func:`index_block_bytes` long), packed or plain.

    Args:
        block: (index_block_bytes(capacity, numel, idx_dtype),) uint8, 8-byte aligned.
        indices: (c,) distinct positions in [0, numel), ``c <= capacity``.
    Returns:
        The permutation that sorted the positions (apply it to their values), or None (plain: order kept).
    """
    c = indices.numel()
    if not packs(capacity, numel, idx_dtype):
        block[:c * idx_dtype.itemsize].view(idx_dtype).copy_(indices.to(idx_dtype))
        return None
    order, offsets, counts = pack_indices(indices, numel)
    cb = chunk_counts_bytes(numel)
    if counts is not None:
        block[:4 * counts.numel()].view(torch.int32).copy_(counts)
    block[cb:cb + 2 * c].view(torch.int16).copy_(offsets)
    return order


def read_indices(block: torch.Tensor, count: int, capacity: int, numel: int, idx_dtype: torch.dtype) -> torch.Tensor:
    """The ``count`` positions :func:`write_indices` wrote into ``block`` (same capacity): (count,) ``idx_dtype``."""
    if not packs(capacity, numel, idx_dtype):
        return block[:count * idx_dtype.itemsize].view(idx_dtype)
    cb = chunk_counts_bytes(numel)
    counts = block[:4 * num_chunks(numel)].view(torch.int32) if cb else None
    return unpack_indices(block[cb:cb + 2 * count].view(torch.int16), counts, numel, idx_dtype)


def dtype_code(dtype: torch.dtype, value_bits: int = 0) -> int:
    """Wire code of a value dtype, plus ``16 × value_bits`` for quantized values (``exchange/quantize.py``:
    8 or 4; 0 for values in the dtype), so ranks on different value formats fail the header check.
    Raises TypeError for dtypes the exchanges do not carry."""
    if dtype not in DTYPE_CODES:
        raise TypeError(f"unsupported gradient dtype {dtype}; supported: {list(DTYPE_CODES)}")
    return DTYPE_CODES[dtype] + 16 * int(value_bits)


def describe_code(code: int) -> str:
    """Readable name of a :func:`dtype_code` (``bfloat16``, ``bfloat16 as int8``)."""
    names = {v: str(k).replace("torch.", "") for k, v in DTYPE_CODES.items()}
    name = names.get(code % 16, str(code))
    return f"{name} as int{code // 16}" if code >= 16 else name


#: wire codes of the exchange schemes, for the agreement check
SCHEME_CODES = {"allgather": 0, "partitioned": 1, "reduce_scatter": 2}


def bucket_code(key: Hashable) -> int:
    """A 56-bit digest of a bucket key (its position, dtype, length and parameter names), equal on every rank
    whose bucket holds the same parameters (``repr`` + blake2b: not Python's per-process ``hash``)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=7).digest(), "little")
