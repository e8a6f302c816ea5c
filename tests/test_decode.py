"""Decode and the sparse scatter ops: the persistent sparse decoder equals a fresh dense decode + scale."""
from __future__ import annotations

import pytest
import torch

from ds_dragonn import sparse_ops
from ds_dragonn.compress.kernels import cpu_table
from ds_dragonn.decode import SparseDecoder, decode_sum

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _pairs(n, world, density, dtype, gen, idx_dtype=torch.int32):
    k = max(1, int(density * n)) if n else 0
    idx = [torch.randperm(n, generator=gen)[:k].to(idx_dtype) for _ in range(world)]
    val = [(torch.randn(k, generator=gen) * 3).to(dtype) for _ in range(world)]
    return idx, val


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 100_003])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("postscale", [1.0, 0.5, 1 / 3])
def test_sparse_decoder_equals_reference_over_steps(dtype, n, world, postscale):
    gen = torch.Generator().manual_seed(n * 31 + world)
    dec = SparseDecoder()
    for step in range(4):
        density = [0.01, 0.5, 1.0, 0.03][step]
        idx, val = _pairs(n, world, density, dtype, gen, torch.int64 if step % 2 else torch.int32)
        out = dec.decode("b", n, idx, val, dtype, torch.device("cpu"), postscale)
        ref = decode_sum(n, idx, val, dtype, torch.device("cpu"), postscale)
        assert torch.equal(out, ref), f"step {step}"


def test_decoder_notices_foreign_writes():
    dec = SparseDecoder()
    idx, val = [torch.tensor([1, 3])], [torch.tensor([1.0, 2.0])]
    out = dec.decode("b", 10, idx, val, torch.float32, torch.device("cpu"))
    out[5] = 7.0  # somebody (e.g. DeepSpeed) wrote into the returned buffer
    out2 = dec.decode("b", 10, [torch.tensor([2])], [torch.tensor([4.0])], torch.float32, torch.device("cpu"))
    assert out2.tolist() == [0, 0, 4.0, 0, 0, 0, 0, 0, 0, 0]


@pytest.mark.skipif(not cpu_table.available(), reason="no C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 5, 70_001])
def test_cpp_sparse_ops_equal_torch_index_ops(dtype, n):
    gen = torch.Generator().manual_seed(n)
    base = (torch.randn(n, generator=gen) * 10).to(dtype)
    base[0] = float("nan") if n > 3 else base[0]
    for idx_dtype in (torch.int32, torch.int64):
        idx = torch.randperm(n, generator=gen)[: max(1, n // 3)].to(idx_dtype)
        v = (torch.randn(idx.numel(), generator=gen) * 5).to(dtype)
        a, b = base.clone(), base.clone()
        cpu_table.sparse_update(a, idx, "add", v)
        b.index_add_(0, idx.long(), v)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) or torch.equal(a, b)
        for scale in (0.5, 1 / 3, 7.0):
            got = cpu_table.sparse_update(a, idx, "gather_scaled", scale=scale)
            want = a.index_select(0, idx.long()).mul_(scale)
            assert torch.equal(got, want) or torch.equal(got.isnan(), want.isnan()) and torch.equal(
                got[~got.isnan()], want[~want.isnan()])
        cpu_table.sparse_update(a, idx, "set", v)
        b[idx.long()] = v
        assert torch.equal(a[~a.isnan()], b[~b.isnan()])
        cpu_table.sparse_update(a, idx, "zero")
        assert bool((a[idx.long()] == 0).all())


def test_scatter_fallback_on_fp16_matches_index_ops():
    dst = torch.randn(100).half()
    idx = torch.tensor([3, 50, 99], dtype=torch.int32)
    v = torch.tensor([1.0, 2.0, 3.0]).half()
    ref = dst.clone().index_add_(0, idx.long(), v)
    sparse_ops.add_(dst, idx, v)
    assert torch.equal(dst, ref)
    sparse_ops.zero_(dst, idx)
    assert bool((dst[idx.long()] == 0).all())


@pytest.mark.skipif(not cpu_table.available(), reason="no C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("postscale", [1.0, 0.5, 1 / 3])
def test_decode_into_tensors_equals_decode(dtype, postscale):
    """Decoding into a bucket's separate (zeroed) tensors, empty ones included, equals the flat decode."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(300, 7), (0,), (1,), (5000,), (13, 11)]
    n = sum(torch.Size(s).numel() for s in shapes)
    for step in range(3):
        idx, val = _pairs(n, 3, [0.01, 0.3, 1.0][step], dtype, gen)
        ref = SparseDecoder().decode("b", n, idx, val, dtype, torch.device("cpu"), postscale)
        tensors = [torch.zeros(s, dtype=dtype) for s in shapes]
        SparseDecoder.decode_into(tensors, idx, val, postscale)
        assert torch.equal(torch.cat([t.flatten() for t in tensors]), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("postscale", [1.0, 1 / 3])
@pytest.mark.parametrize("n", [1, 7, 5001])
def test_decode_into_one_flat_tensor_equals_decode(dtype, postscale, n):
    """One contiguous tensor (DeepSpeed's ZeRO 1/2 bucket, ZeRO 3's rank-major copy) on torch's own path (float64:
    no CPU library): bit-identical to the decode buffer, overlapping ranks included; fp16 and strided tensors
    are not served (their decode keeps a buffer)."""
    gen = torch.Generator().manual_seed(n)
    for density in (0.01, 1.0):
        idx, val = _pairs(n, 3, density, dtype, gen)
        ref = SparseDecoder().decode("b", n, idx, val, dtype, torch.device("cpu"), postscale)
        flat = torch.zeros(n, dtype=dtype)
        assert SparseDecoder.serves([flat])
        SparseDecoder.decode_into([flat], idx, val, postscale)
        assert torch.equal(flat, ref)
    assert not SparseDecoder.serves([torch.zeros(n, dtype=torch.float16)])
    assert not SparseDecoder.serves([torch.zeros(n + 1, 2, dtype=torch.float64).t()])


@pytest.mark.skipif(not cpu_table.available(), reason="no C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", [1.0, 0.25])
def test_cpp_compensate_zeroes_inputs_and_matches_torch(dtype, alpha):
    gen = torch.Generator().manual_seed(5)
    shapes = [(70_001,), (0,), (3, 5)]
    g = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    res = torch.randn(70_016, generator=gen)
    want = res + torch.cat([t.flatten() for t in g]).float() * alpha
    cpu_table.compensate(res, g, alpha, zero_inputs=True)
    if alpha == 1.0:
        assert torch.equal(res, want)  # one rounding, like Tensor.add_
    else:
        torch.testing.assert_close(res, want, rtol=1e-6, atol=1e-6)
    assert all(bool((t == 0).all()) for t in g)


@pytest.mark.parametrize("bad", [-1, 10])
def test_out_of_range_indices_are_refused_before_any_write(bad):
    dec = SparseDecoder()
    good = [torch.tensor([1, 2], dtype=torch.int32)]
    out = dec.decode("b", 10, good, [torch.tensor([1.0, 2.0])], torch.float32, torch.device("cpu"))
    before = out.clone()
    idx = [torch.tensor([3], dtype=torch.int32), torch.tensor([0, bad], dtype=torch.int32)]
    with pytest.raises(ValueError, match="rank 1 sent indices"):
        dec.decode("b", 10, idx, [torch.tensor([1.0]), torch.tensor([1.0, 1.0])], torch.float32, torch.device("cpu"))
    assert torch.equal(out, before)
    tensors = [torch.zeros(4), torch.zeros(6)]
    with pytest.raises(ValueError, match="outside the bucket"):
        SparseDecoder.decode_into(tensors, idx, [torch.tensor([1.0]), torch.tensor([1.0, 1.0])])
    assert all(bool((t == 0).all()) for t in tensors)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fp16_sums_are_formed_in_float32(world):
    """P ranks of fp16 30000.0 (sum > 65504, mean < 65504): the decoded mean is 30000, not Inf, in the reference
    and in the persistent decoder, over steps whose positions change."""
    dec = SparseDecoder()
    for step, n in enumerate([1000, 1000, 1000]):
        idx = [torch.arange(step, n, 2 + step) for _ in range(world)]
        val = [torch.full((i.numel(),), 30000.0, dtype=torch.float16) for i in idx]
        want = torch.zeros(n, dtype=torch.float16)
        want[idx[0]] = 30000.0
        assert torch.equal(decode_sum(n, idx, val, torch.float16, torch.device("cpu"), 1.0 / world), want), step
        out = dec.decode("b", n, idx, val, torch.float16, torch.device("cpu"), 1.0 / world)
        assert torch.equal(out, want), step
