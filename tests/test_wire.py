"""Packed positions on the wire (``exchange/wire.py``): 16-bit chunk offsets + per-chunk counts.

Round trips against the original positions at awkward sizes (0, 1, one chunk, a chunk ± 1, many chunks,
int32 and int64), and the allgather of pairs between simulated ranks with different counts, checked
against a float64 dense sum of every rank's pairs, with its exact byte count.
"""
from __future__ import annotations

import threading

import pytest
import torch

from ds_dragonn.comm.base import CommBackend
from ds_dragonn.compress.base import index_dtype
from ds_dragonn.exchange.allgather import AllgatherExchange, HEADER_INTS, gather_pairs
from ds_dragonn.exchange.wire import (CHUNK_BITS, align, chunk_counts_bytes, index_block_bytes, index_bytes, num_chunks,
                                      pack_indices, packs, read_indices, unpack_indices, write_indices)

CHUNK = 1 << CHUNK_BITS
SIZES = [0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


def _positions(n: int, c: int, gen: torch.Generator, dtype=torch.int32) -> torch.Tensor:
    """``c`` distinct positions in [0, n), the chunk edges among them where they fit, in random order."""
    edges = torch.tensor([p for p in dict.fromkeys((0, CHUNK - 1, CHUNK, n - 1)) if 0 <= p < n][:c], dtype=torch.long)
    rest = torch.randperm(n, generator=gen)
    rest = rest[~torch.isin(rest, edges)][:c - edges.numel()]
    idx = torch.cat([edges, rest])
    return idx[torch.randperm(idx.numel(), generator=gen)].to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_pack_round_trip(n, dtype):
    gen = torch.Generator().manual_seed(n + 1)
    for c in sorted({0, 1, min(n, 3), min(n, 1000), n if n <= 5000 else 5000}):
        if c > n:
            continue
        idx = _positions(n, c, gen, dtype)
        order, offsets, counts = pack_indices(idx, n)
        assert offsets.dtype == torch.int16 and offsets.numel() == idx.numel()
        assert (counts is None) == (num_chunks(n) == 1)
        if counts is not None:
            assert counts.dtype == torch.int32 and counts.numel() == num_chunks(n) and int(counts.sum()) == idx.numel()
        back = unpack_indices(offsets, counts, n, dtype)
        assert back.dtype == dtype
        assert torch.equal(back, idx[order]), "positions changed on the round trip"
        assert torch.equal(back, torch.sort(idx).values), "packed positions must come back sorted"


def test_byte_model():
    assert num_chunks(0) == num_chunks(1) == num_chunks(CHUNK) == 1 and num_chunks(CHUNK + 1) == 2
    assert chunk_counts_bytes(CHUNK) == 0 and chunk_counts_bytes(CHUNK + 1) == 8
    assert index_bytes(0, 10) == 0 and index_bytes(1, 10) == 8 and index_bytes(8, 10) == 16
    # the LM of the benchmarks: 1.85 M parameters, k = 1 %: a bf16 pair costs 4 bytes (+ 29 int32 counts)
    n, k = 1_850_000, 18_504
    assert packs(k, n, torch.int32) and index_block_bytes(k, n, torch.int32) == align(4 * num_chunks(n)) + 2 * k
    # a few positions in a huge buffer: the chunk counts would cost more than int32 indices save
    assert not packs(8, 1 << 30, torch.int32) and index_block_bytes(8, 1 << 30, torch.int32) == 32
    assert not packs(0, CHUNK, torch.int32) and index_block_bytes(0, CHUNK, torch.int32) == 0


@pytest.mark.parametrize("n,c", [(10, 3), (CHUNK + 1, 2), (5 * CHUNK, 40), (1 << 28, 5), (1 << 28, 3000)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_write_read_block(n, c, dtype):
    """Packed or plain, whichever is smaller: the block reads back the positions, in the order the values
    must follow (sorted when packed, as given when plain)."""
    gen = torch.Generator().manual_seed(c)
    idx = (torch.randperm(min(n, 1 << 20), generator=gen)[:c] * (n // min(n, 1 << 20))).to(dtype)
    for cap in (c, align(c) + 8):
        block = torch.zeros(index_block_bytes(cap, n, dtype), dtype=torch.uint8)
        order = write_indices(block, idx, cap, n, dtype)
        assert (order is not None) == packs(cap, n, dtype)
        back = read_indices(block, c, cap, n, dtype)
        assert back.dtype == dtype and torch.equal(back, idx if order is None else idx[order])


class ThreadGroup:
    """In-process ranks: every rank runs in its own thread; collectives meet at a barrier."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots = [None] * world

    def backend(self, rank: int) -> CommBackend:
        group = self

        class _Backend(CommBackend):
            name = "threads"

            @property
            def rank(self):
                return rank

            @property
            def world_size(self):
                return group.world

            def _gather(self, item):
                group.barrier.wait()
                group.slots[rank] = item
                group.barrier.wait()
                out = list(group.slots)
                group.barrier.wait()
                return out

            def all_gather_ints(self, values, device):
                return [list(v) for v in self._gather(list(values))]

            def all_gather_bytes(self, payload):
                rows = self._gather(payload.clone())
                assert len({r.numel() for r in rows}) == 1, "ranks sent rows of different lengths"
                return torch.stack(rows)

            def all_to_all_bytes(self, payload, send_sizes, recv_sizes):
                raise NotImplementedError

            def all_reduce_sum_(self, tensor):
                tensor.copy_(sum(self._gather(tensor.clone())))

        return _Backend()

    def run(self, fn):
        out, errors = [None] * self.world, []

        def body(r):
            try:
                out[r] = fn(r, self.backend(r))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return out


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 100, CHUNK + 1, 3 * CHUNK + 5])
@pytest.mark.parametrize("wire_dtype", [torch.float32, torch.bfloat16])
def test_gather_pairs_between_ranks(world, n, wire_dtype):
    """Every rank decodes the same lists; the sum of all pairs equals the float64 sum of what every rank
    selected, whatever the counts (0 on some ranks, all of the buffer on others); the payload is exactly
    the packed row of the largest count."""
    gen = torch.Generator().manual_seed(world * 1000 + n)
    counts = [int(torch.randint(0, min(n, 3000) + 1, (1,), generator=gen)) for _ in range(world)]
    counts[0] = 0  # a rank with nothing to send
    if world > 1:
        counts[-1] = min(n, 3000)
    picks = [_positions(n, c, gen) for c in counts]
    values = [torch.randn(c, generator=gen, dtype=torch.float64).to(wire_dtype) for c in counts]
    group = ThreadGroup(world)
    idt = index_dtype(n)

    def rank_fn(r, backend):
        return gather_pairs(picks[r], values[r], counts, n, idt, wire_dtype, backend)

    results = group.run(rank_fn)
    expect = torch.zeros(n, dtype=torch.float64)
    for i, v in zip(picks, values):
        expect.index_add_(0, i.long(), v.double())
    for r, (idx, val, payload, _) in enumerate(results):
        got = torch.zeros(n, dtype=torch.float64)
        for i, v, c in zip(idx, val, counts):
            assert i.dtype == idt and i.numel() == v.numel() == c
            got.index_add_(0, i.long(), v.double())
        assert torch.equal(got, expect), f"rank {r} decoded other pairs than were sent"
        top = max(counts)
        assert payload == (0 if top == 0 else index_block_bytes(align(top), n, idt) + align(top) * wire_dtype.itemsize)
        bound = AllgatherExchange(group.backend(r)).max_bytes(n, top, wire_dtype, world)
        assert (world - 1) * (HEADER_INTS * 8 + payload) <= bound


def test_gather_pairs_whole_tail_travels_without_positions():
    """The last ``whole`` pairs (per-tensor whole tensors, the same positions on every rank) keep their
    order and positions; only the head is packed and sorted."""
    n, world = CHUNK + 10, 2
    tail = torch.arange(n - 4, n, dtype=torch.int32)
    heads = [torch.tensor([70_000, 5, 65_536], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)]
    picks = [torch.cat([h, tail]) for h in heads]
    values = [torch.arange(p.numel(), dtype=torch.float32) + 10 * r for r, p in enumerate(picks)]
    counts = [p.numel() for p in picks]
    out = ThreadGroup(world).run(lambda r, b: gather_pairs(picks[r], values[r], counts, n, torch.int32,
                                                            torch.float32, b, whole=4))
    idx, val, *_ = out[1]
    assert idx[0].tolist() == [5, 65_536, 70_000] + tail.tolist()
    assert val[0].tolist() == [1.0, 2.0, 0.0, 3.0, 4.0, 5.0, 6.0]
    assert idx[1].tolist() == [9] + tail.tolist() and val[1].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (launch/gpu_check.sh runs it)")
@pytest.mark.parametrize("n", [CHUNK - 1, 3 * CHUNK + 5, 1 << 24])
def test_pack_round_trip_on_cuda(n):
    """The same packing on CUDA tensors, against the CPU's (no device sync is needed to size the output)."""
    gen = torch.Generator().manual_seed(n)
    idx = _positions(n, min(n, 50_000), gen)
    order, offsets, counts = pack_indices(idx.cuda(), n)
    c_order, c_offsets, c_counts = pack_indices(idx, n)
    assert torch.equal(offsets.cpu(), c_offsets) and torch.equal(order.cpu(), c_order)
    assert (counts is None and c_counts is None) or torch.equal(counts.cpu(), c_counts)
    back = unpack_indices(offsets, counts, n, torch.int32)
    assert back.is_cuda and torch.equal(back.cpu(), torch.sort(idx).values)
