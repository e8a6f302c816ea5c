"""Triton kernels of the DRAGONN selection (GPU; CPU under ``TRITON_INTERPRET=1`` for tests).

``_table_kernel``: one pass over the buffer, one program per ``BLOCK`` elements. Each element is loaded
once, its magnitude ``float32(|x|)`` (NaN → +Inf) compared with the threshold read from device memory
(no host sync), and a selected element's priority key ``(mag_bits >> (b−32)) << b | index`` goes into
slot ``murmur3(index, seed) mod m`` with ``tl.atomic_max`` on the int64 table (initialised to
``EMPTY_SLOT = -1``). No sort, no prefix sum, no ``nonzero`` over the buffer; the collision winner is the
same as the reference's ``scatter_reduce(amax)``. Indices are int64 (``program_id`` widened before the
multiply), so buffers past 2^31 elements are addressed correctly.

``_sample_kernel``: the stratified hashed sample of ``dragonn.sample_positions`` — positions, load,
magnitude (non-finite → 0) in one kernel; ``torch.topk`` of the s magnitudes then gives the threshold.

MurmurHash3_x86_32 runs in uint32 arithmetic (wrapping multiplies, logical shifts) and matches
``hashing.murmur3_index_hash`` bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..base import EMPTY_SLOT
from ..reference import index_bits

BLOCK = 1024


@triton.jit
def _rotl32(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _mix(h, k):
    k = k * tl.full(k.shape, 0xCC9E2D51, tl.uint32)
    k = _rotl32(k, 15)
    k = k * tl.full(k.shape, 0x1B873593, tl.uint32)
    h = h ^ k
    h = _rotl32(h, 13)
    return h * tl.full(h.shape, 5, tl.uint32) + tl.full(h.shape, 0xE6546B64, tl.uint32)


@triton.jit
def _murmur3_index(idx, seed):
    """MurmurHash3_x86_32 of int64 ``idx`` (8-byte LE key) with a uint32 seed → int64 in [0, 2^32)."""
    lo = (idx & 0xFFFFFFFF).to(tl.uint32)
    hi = ((idx >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = tl.full(idx.shape, 0, tl.uint32) + seed.to(tl.uint32)
    h = _mix(h, lo)
    h = _mix(h, hi)
    h = h ^ tl.full(h.shape, 8, tl.uint32)
    h = h ^ (h >> 16)
    h = h * tl.full(h.shape, 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full(h.shape, 0xC2B2AE35, tl.uint32)
    h = h ^ (h >> 16)
    return h.to(tl.int64) & 0xFFFFFFFF


@triton.jit
def _table_kernel(x_ptr, thr_ptr, table_ptr, n, m, seed, IBITS: tl.constexpr, DIRECT: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < n
    x = tl.load(x_ptr + offs, mask=inb, other=0.0)
    mag = tl.abs(x.to(tl.float32))
    mag = tl.where(mag != mag, float("inf"), mag)  # NaN counts as +Inf
    thr = tl.load(thr_ptr)
    sel = inb & (mag >= thr) & (mag > 0.0)
    mbits = mag.to(tl.int32, bitcast=True).to(tl.int64) >> (IBITS - 32)
    key = (mbits << IBITS) | offs
    if DIRECT:
        slot = offs
    else:
        slot = _murmur3_index(offs, seed) % m
    tl.atomic_max(table_ptr + slot, key, mask=sel)


@triton.jit
def _sample_kernel(x_ptr, out_ptr, s, q, r, seed, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    j = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = j < s
    start = j * q + (j * r) // s
    end = (j + 1) * q + ((j + 1) * r) // s
    pos = start + _murmur3_index(j, seed) % tl.maximum(end - start, 1)
    x = tl.load(x_ptr + pos, mask=ok, other=0.0)
    mag = tl.abs(x.to(tl.float32))
    finite = (mag == mag) & (mag != float("inf"))
    tl.store(out_ptr + j, tl.where(finite, mag, 0.0), mask=ok)


def build_table(flat: torch.Tensor, threshold: torch.Tensor, capacity: int, seed: int) -> torch.Tensor:
    """Same contract as ``dragonn.build_table``; the threshold never leaves the device."""
    flat = flat.contiguous()
    n = flat.numel()
    table = torch.full((capacity,), EMPTY_SLOT, dtype=torch.int64, device=flat.device)
    if n == 0:
        return table
    thr = threshold.to(device=flat.device, dtype=torch.float32).reshape(1)
    grid = (triton.cdiv(n, BLOCK),)
    _table_kernel[grid](flat, thr, table, n, capacity, int(seed) & 0xFFFFFFFF,
                        IBITS=index_bits(n), DIRECT=capacity >= n, BLOCK=BLOCK)
    return table


def sample_magnitudes(flat: torch.Tensor, num_samples: int, seed: int) -> torch.Tensor:
    """(s,) float32 magnitudes (non-finite → 0) at ``dragonn.sample_positions(n, s, seed)``."""
    flat = flat.contiguous()
    n = flat.numel()
    q, r = divmod(n, num_samples)
    out = torch.empty(num_samples, dtype=torch.float32, device=flat.device)
    grid = (triton.cdiv(num_samples, BLOCK),)
    _sample_kernel[grid](flat, out, num_samples, q, r, int(seed) & 0xFFFFFFFF, BLOCK=BLOCK)
    return out
