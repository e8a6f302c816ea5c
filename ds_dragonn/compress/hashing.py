"""MurmurHash3_x86_32 of element indices, in pure PyTorch integer arithmetic.

DRAGONN (Wang et al., ICML 2022, Sec. 3.2) hashes each selected index into a table slot with
MurmurHash3_x86_32, with a seed that changes every step. Here the key is the index as an 8-byte
little-endian integer (two 32-bit blocks), so indices beyond 2^32 hash without aliasing and every
backend (this reference, the Triton kernel) computes the same slot.

All arithmetic is on int64 tensors holding 32-bit values; products are split so that no intermediate
exceeds 2^63 (no reliance on signed overflow).
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), c a 32-bit constant, without int64 overflow."""
    lo = x * (c & 0xFFFF)  # < 2^48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # only the low 16 bits survive the shift mod 2^32
    return (lo + hi) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _mix_block(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(k, _C1)
    k = _rotl32(k, 15)
    k = _mul32(k, _C2)
    h = h ^ k
    h = _rotl32(h, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_index_hash(indices: torch.Tensor, seed: int) -> torch.Tensor:
    """MurmurHash3_x86_32 of each index taken as an 8-byte little-endian key.

    Args:
        indices: integer tensor of any shape, values in [0, 2^63).
        seed: 32-bit seed (taken mod 2^32).
    Returns:
        int64 tensor of the same shape with hash values in [0, 2^32).
    """
    idx = indices.to(torch.int64)
    h = torch.full_like(idx, int(seed) & _M32)
    h = _mix_block(h, idx & _M32)
    h = _mix_block(h, (idx >> 32) & _M32)
    h = h ^ 8  # key length in bytes
    return fmix32(h)


def murmur3_reference(index: int, seed: int) -> int:
    """Scalar MurmurHash3_x86_32 of ``index.to_bytes(8, 'little')`` — an independent check for tests."""
    data = int(index).to_bytes(8, "little")
    h = seed & _M32
    for i in range(0, 8, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * _C1) & _M32
        k = ((k << 15) | (k >> 17)) & _M32
        k = (k * _C2) & _M32
        h ^= k
        h = ((h << 13) | (h >> 19)) & _M32
        h = (h * 5 + 0xE6546B64) & _M32
    h ^= 8
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    h ^= h >> 16
    return h
