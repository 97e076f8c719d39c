"""Triton sparse MLA kernels (minidsa/ops/mla/latent_triton.py) against their references.

Without a GPU the kernels run in Triton's interpreter (conftest.py), where every program instance
costs milliseconds: shapes stay tiny and odd (r=60, dr=12, H=3 exercise every mask), and fp32 is
used because the interpreter's tl.dot on bf16 is wrong (docs/design.md §10 trap 9). On a GPU the
same tests run compiled, plus bf16 cases.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

pytest.importorskip("triton")

from conftest import kernel_device  # noqa: E402

from minidsa.ops.mla import latent_triton as mt  # noqa: E402
from minidsa.ops.mla.reference import sparse_mla_decode_ref, sparse_mla_prefill_ref  # noqa: E402

# fp32 tolerance: the kernel uses IEEE fp32 dots (no TF32) and an online softmax, so it differs from
# the reference only in summation order: with O(1) values and at most ~100 terms per sum that is a
# few ulps of fp32 (~1e-6); 2e-5 leaves room without hiding a wrong mask (which costs ~1e-1).
FP32_TOL = dict(atol=2e-5, rtol=2e-5)


def paged_case(B, T, K, r, dr, bs, contexts, *, dtype=torch.float32, device="cpu", seed=0):
    """Planes full of NaN except the rows some query selects, an out-of-order block table with -1 after
    each sequence's last block, and indices [B, T, K]: distinct positions < context, -1 sprinkled
    inside rows, and the last query of batch row 0 entirely -1."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(c / bs) for c in contexts]
    max_blocks = max(nblocks) + 1  # at least one -1 entry per row
    num_blocks = sum(nblocks) + 2  # two blocks nobody owns (NaN throughout)
    perm = torch.randperm(num_blocks, generator=g).int()
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblocks):
        table[b, :n] = perm[used: used + n]
        used += n
    indices = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            pick = torch.randperm(contexts[b], generator=g)[:K].int()
            indices[b, t, : pick.numel()] = pick
    indices[torch.rand(B, T, K, generator=g) < 0.2] = -1  # padding in the middle of rows
    indices[0, -1] = -1  # a query with nothing selected
    kv = torch.full((num_blocks, bs, r), float("nan"))
    pe = torch.full((num_blocks, bs, dr), float("nan"))
    for b in range(B):
        pos = torch.unique(indices[b][indices[b] >= 0].long())
        slots = table[b].long()[pos // bs] * bs + pos % bs
        kv.view(-1, r)[slots] = torch.randn(pos.numel(), r, generator=g)
        pe.view(-1, dr)[slots] = torch.randn(pos.numel(), dr, generator=g)
    to = dict(device=device)
    return kv.to(dtype=dtype, **to), pe.to(dtype=dtype, **to), table.to(**to), indices.to(**to)


def test_signatures_match_the_references():
    assert inspect.signature(mt.sparse_mla_decode) == inspect.signature(sparse_mla_decode_ref)
    absorbed = inspect.signature(mt.sparse_mla_prefill_absorbed)  # the reference's, and the sm_90 module to use
    assert absorbed.replace(parameters=list(absorbed.parameters.values())[:-1]) == inspect.signature(sparse_mla_prefill_ref)
    assert absorbed.parameters["gluon"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("r, dr, offsets", [(60, 12, "int32"), (32, 16, "int32"), (60, 12, "int64")])
def test_decode_matches_reference_on_odd_shapes_with_nan_in_unselected_rows(r, dr, offsets, monkeypatch):
    # r = 60: masked columns; 32: power-of-two widths (no column mask). Planes this small take int32 row
    # offsets; forcing the int64 ones (a cache past 2^31 elements) must give the same answer.
    if offsets == "int64":
        monkeypatch.setattr(mt, "INT32_OFFSETS_BELOW", 0)
    dev = kernel_device()
    B, T, H, K, bs = 2, 2, 3, 24, 8
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[37, 21], device=dev)
    q_lat = torch.randn(B, T, H, r, device=dev)
    q_pe = torch.randn(B, T, H, dr, device=dev)
    out = mt.sparse_mla_decode(q_lat, q_pe, kv, pe, table, idx, 0.15)
    ref = sparse_mla_decode_ref(q_lat, q_pe, kv, pe, table, idx, 0.15)
    assert out.dtype == torch.float32 and out.shape == (B, T, H, r)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **FP32_TOL)
    assert (out[0, -1] == 0).all()  # all -1: zeros, like the reference


@pytest.mark.parametrize("layout", ["one-tensor views", "blocks apart", "block size 1", "strided columns"])
def test_decode_addresses_planes_of_any_layout(layout):
    # The kernel addresses row (block * bs + offset) at row * row stride: true for the planes the cache
    # allocates and for column views of one [blocks, bs, r + dr] tensor; planes whose blocks are not back
    # to back are copied first, and a block size of 1 uses the block stride.
    dev = kernel_device()
    B, T, H, r, dr, K = 2, 1, 3, 60, 12, 16
    bs = 1 if layout == "block size 1" else 4
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[23, 19], device=dev, seed=5)
    if layout == "one-tensor views":
        both = torch.cat([kv, pe], -1)
        kv, pe = both[..., :r], both[..., r:]
    elif layout == "blocks apart":  # [bs, blocks, w] storage seen as [blocks, bs, w]
        kv = kv.transpose(0, 1).contiguous().transpose(0, 1)
        pe = pe.transpose(0, 1).contiguous().transpose(0, 1)
        assert kv.stride(0) != bs * kv.stride(1)
    elif layout == "strided columns":  # every other element of wider rows
        kv = torch.stack([kv, kv], -1).flatten(-2)[..., ::2]
        pe = torch.stack([pe, pe], -1).flatten(-2)[..., ::2]
        assert kv.stride(-1) == 2
    q_lat = torch.randn(B, T, H, r, device=dev)
    q_pe = torch.randn(B, T, H, dr, device=dev)
    out = mt.sparse_mla_decode(q_lat, q_pe, kv, pe, table, idx, 0.15)
    torch.testing.assert_close(out, sparse_mla_decode_ref(q_lat, q_pe, kv, pe, table, idx, 0.15), **FP32_TOL)


def test_decode_split_path_matches_reference_and_is_deterministic():
    """Flash-decoding split (3 fixed ranges of K) + combine; one split holds only padding."""
    dev = kernel_device()
    B, T, H, r, dr, K, bs = 2, 1, 3, 60, 12, 40, 4
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[50, 23], device=dev, seed=1)
    idx[1, 0, 16:32] = -1  # split 1 of row 1 (BLOCK_N=16 -> splits cover 16 positions) is empty
    q_lat = torch.randn(B, T, H, r, device=dev)
    q_pe = torch.randn(B, T, H, dr, device=dev)
    ref = sparse_mla_decode_ref(q_lat, q_pe, kv, pe, table, idx, 0.2)
    outs = []
    for _ in range(2):
        out = torch.zeros_like(ref)
        mt._latent_attention(q_lat, q_pe, kv, pe, table, idx, 0.2, out, out.stride()[:3], num_splits=3)
        outs.append(out)
    torch.testing.assert_close(outs[0], ref, **FP32_TOL)
    assert torch.equal(outs[0], outs[1])  # fixed split order, no atomics: bitwise repeatable


def test_position_in_a_missing_block_is_padding():
    """A table entry of -1 ("no block") or a position past the table is never read and counts as
    padding, in the kernel and in the reference alike (the model never selects such a position)."""
    dev = kernel_device()
    B, T, H, r, dr, K, bs = 1, 2, 3, 20, 12, 8, 4
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[16], device=dev, seed=2)
    table[0, 1] = -1  # positions 4..7 lose their block
    idx[0, 0, :3] = torch.tensor([5, 6, 4 * table.shape[1] + 1], dtype=torch.int32)  # no block, past table
    q_lat = torch.randn(B, T, H, r, device=dev)
    q_pe = torch.randn(B, T, H, dr, device=dev)
    as_padding = idx.clone()
    blk = idx.long().clamp_min(0) // bs
    missing = (blk >= table.shape[1]) | (table[0].long()[blk.clamp_max(table.shape[1] - 1)] < 0)
    as_padding[missing] = -1
    out = mt.sparse_mla_decode(q_lat, q_pe, kv, pe, table, idx, 0.3)
    ref = sparse_mla_decode_ref(q_lat, q_pe, kv, pe, table, as_padding, 0.3)
    torch.testing.assert_close(out, ref, **FP32_TOL)
    torch.testing.assert_close(sparse_mla_decode_ref(q_lat, q_pe, kv, pe, table, idx, 0.3), ref, **FP32_TOL)


@pytest.mark.slow  # several tiles in the interpreter
def test_prefill_matches_reference_across_tiles():
    """T = 70 spans two 64-query tiles of the reference; contexts differ per batch row."""
    dev = kernel_device()
    B, T, H, r, dr, dn, dv, K, bs = 2, 70, 3, 60, 12, 10, 7, 20, 8
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[90, 45], device=dev, seed=3)
    q = torch.randn(B, T, H, dn + dr, device=dev)
    w = torch.randn(H * (dn + dv), r, device=dev) / math.sqrt(r)
    scale = (dn + dr) ** -0.5
    out = mt.sparse_mla_prefill_absorbed(q, kv, pe, table, idx, w, scale)
    ref = sparse_mla_prefill_ref(q, kv, pe, table, idx, w, scale)
    assert out.dtype == torch.float32 and out.shape == (B, T, H, dv)
    assert torch.isfinite(out).all()
    # Absorbed vs decompressed order of the same fp32 products: a few ulps more than decode.
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)
    assert (out[0, -1] == 0).all()
    again = mt.sparse_mla_prefill_absorbed(q, kv, pe, table, idx, w, scale)
    assert torch.equal(out, again)


def test_bad_inputs_raise_like_the_reference():
    B, T, H, r, dr = 1, 1, 2, 16, 16
    q_lat, q_pe = torch.randn(B, T, H, r), torch.randn(B, T, H, dr)
    kv, pe = torch.randn(2, 4, r), torch.randn(2, 4, dr)
    table, idx = torch.zeros(B, 2, dtype=torch.int32), torch.zeros(B, T, 3, dtype=torch.int32)
    bad_calls = [
        (q_lat, q_pe, kv, pe, table.float(), idx, 1.0),  # float block table
        (q_lat, q_pe[..., :-1], kv, torch.randn(2, 4, dr), table, idx, 1.0),  # dr mismatch
        (q_lat, q_pe, kv, pe, table, idx[0], 1.0),  # indices of the wrong rank
        ("q", q_pe, kv, pe, table, idx, 1.0),  # not a tensor
    ]
    for args in bad_calls:
        with pytest.raises((TypeError, ValueError)) as want:
            sparse_mla_decode_ref(*args)
        with pytest.raises(want.type, match=str(want.value).replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            mt.sparse_mla_decode(*args)
    w = torch.randn(H * 5, r)  # dn = 16 - ... : H*(dn+dv) inconsistent with q's dn
    q = torch.randn(B, T, H, 8 + dr)
    with pytest.raises(ValueError, match="kv_b_weight"):
        mt.sparse_mla_prefill_absorbed(q, kv, pe, table, idx, w, 1.0)


def test_fp64_inputs_give_the_reference_result():
    B, T, H, r, dr, K, bs = 1, 2, 2, 8, 4, 5, 4
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[12], dtype=torch.float64, seed=4)
    q_lat, q_pe = torch.randn(B, T, H, r, dtype=torch.float64), torch.randn(B, T, H, dr, dtype=torch.float64)
    out = mt.sparse_mla_decode(q_lat, q_pe, kv, pe, table, idx, 0.5)
    assert out.dtype == torch.float64
    assert torch.equal(out, sparse_mla_decode_ref(q_lat, q_pe, kv, pe, table, idx, 0.5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is only meaningful compiled on a GPU")
def test_bf16_decode_and_prefill_on_gpu():
    """bf16 planes at the real widths (r=512, dr=64). The kernel rounds q and p to bf16 for the tensor
    cores (relative error 2^-9 each) where the reference upcasts to fp32; outputs are convex
    combinations of O(1) rows, so 2e-2 absolute covers it with margin. Prefill also rounds q_latent
    and o_latent to bf16 while the reference rounds the decompressed k, v: 3% of the output scale."""
    dev = "cuda"
    B, T, H, r, dr, dn, dv, K, bs = 3, 1, 16, 512, 64, 128, 128, 300, 64
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[1000, 700, 301], dtype=torch.bfloat16,
                                    device=dev, seed=5)
    q_lat = torch.randn(B, T, H, r, device=dev)
    q_pe = torch.randn(B, T, H, dr, device=dev)
    scale = (dn + dr) ** -0.5
    out = mt.sparse_mla_decode(q_lat, q_pe, kv, pe, table, idx, scale)
    ref = sparse_mla_decode_ref(q_lat, q_pe, kv, pe, table, idx, scale)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(out, mt.sparse_mla_decode(q_lat, q_pe, kv, pe, table, idx, scale))
    # fp32 planes at the real widths take the smaller fp32 tiles (shared memory and registers).
    out = mt.sparse_mla_decode(q_lat, q_pe, kv.float(), pe.float(), table, idx, scale)
    ref = sparse_mla_decode_ref(q_lat, q_pe, kv.float(), pe.float(), table, idx, scale)
    torch.testing.assert_close(out, ref, **FP32_TOL)
    T = 100
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[1000, 700, 301], dtype=torch.bfloat16,
                                    device=dev, seed=6)
    q = torch.randn(B, T, H, dn + dr, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(H * (dn + dv), r, device=dev) / math.sqrt(r)).bfloat16()
    out = mt.sparse_mla_prefill_absorbed(q, kv, pe, table, idx, w, scale)
    ref = sparse_mla_prefill_ref(q, kv, pe, table, idx, w, scale)
    torch.testing.assert_close(out, ref, atol=3e-2 * float(ref.abs().max()), rtol=3e-2)


def test_prefill_position_in_a_missing_block_is_padding():
    """Prefill treats a position whose block is -1 as padding, in the kernel and the reference alike:
    the same output as with those indices replaced by -1."""
    dev = kernel_device()
    B, T, H, r, dr, dn, dv, K, bs = 1, 5, 2, 20, 12, 6, 5, 8, 4
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[16], device=dev, seed=4)
    kv, pe = torch.nan_to_num(kv), torch.nan_to_num(pe)  # the dropped block's rows must hold numbers
    q = torch.randn(B, T, H, dn + dr, device=dev)
    w = torch.randn(H * (dn + dv), r, device=dev) / math.sqrt(r)
    idx[0, :, 0] = 5  # every query selects position 5 ...
    table[0, 1] = -1  # ... whose block (positions 4..7) is then dropped
    as_padding = torch.where((idx // bs == 1) & (idx >= 0), torch.full_like(idx, -1), idx)
    want = sparse_mla_prefill_ref(q, kv, pe, table, as_padding, w, 0.3)
    torch.testing.assert_close(sparse_mla_prefill_ref(q, kv, pe, table, idx, w, 0.3), want, atol=1e-6, rtol=1e-6)
    got = mt.sparse_mla_prefill_absorbed(q, kv, pe, table, idx, w, 0.3)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)
