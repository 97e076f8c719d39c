"""Sparse MLA prefill kernels (minidsa/ops/mla/prefill_*.py) against the reference.

Under the interpreter (no GPU) shapes stay tiny and odd and everything is fp32 (bf16 tl.dot is wrong
there, docs/design.md §10 trap 9). The planes come from ``paged_case``: NaN in every row no query
selects, an out-of-order block table, -1 padding inside rows and a query with nothing selected.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

pytest.importorskip("triton")

from conftest import kernel_device  # noqa: E402
from test_triton_mla import paged_case  # noqa: E402

from minidsa.ops.mla import prefill_attn_triton as pa  # noqa: E402
from minidsa.ops.mla import prefill_form as pf  # noqa: E402
from minidsa.ops.mla import prefill_triton as mp  # noqa: E402
from minidsa.ops.mla import prefill_union_triton as pu  # noqa: E402
from minidsa.ops.mla.reference import sparse_mla_prefill_ref  # noqa: E402
from minidsa.ops.paging import paged_kv_slots  # noqa: E402

# fp32: IEEE dots (no TF32) and an online softmax: the union form differs from the reference only in the
# order of the sums (a few fp32 ulps at O(1) values); the absorbed form also reorders the W_kvb products.
# A wrong mask entry costs ~1e-1.
FP32_TOL = dict(atol=5e-5, rtol=5e-5)


def prefill_case(B=2, T=63, H=3, r=20, dr=8, dn=52, dv=10, K=9, bs=4, contexts=(63, 40), seed=0):
    """dn + dr = 60, T = 63 (not a multiple of the tile), contexts that differ per sequence."""
    dev = kernel_device()
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=list(contexts), device=dev, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(B, T, H, dn + dr, generator=g).to(dev)
    w = (torch.randn(H * (dn + dv), r, generator=g) / math.sqrt(r)).to(dev)
    return q, kv, pe, table, idx, w, (dn + dr) ** -0.5


def test_signature_is_the_reference_signature():
    assert inspect.signature(mp.sparse_mla_prefill) == inspect.signature(sparse_mla_prefill_ref)


@pytest.mark.parametrize("form", [pytest.param("union", marks=pytest.mark.slow), "absorbed",
                                  pytest.param("auto", marks=pytest.mark.slow)])
def test_each_form_matches_the_reference(form, monkeypatch):
    monkeypatch.setattr(pf, "FORM", form)
    q, kv, pe, table, idx, w, scale = prefill_case()
    out = mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale)
    ref = sparse_mla_prefill_ref(q, kv, pe, table, idx, w, scale)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all()  # NaN rows nobody selected are never read
    torch.testing.assert_close(out, ref, **FP32_TOL)
    assert (out[0, -1] == 0).all()  # the query with nothing selected
    assert torch.equal(out, mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale))  # run to run


def test_a_table_within_top_k_takes_the_union_form_reading_nothing_back(monkeypatch):
    """A block table that reaches no further than top-k (a prompt shorter than top-k): inside sync_free(), as a
    captured step runs it, the union form with buffers sized from the shapes, no count read back; equal to the
    reference. A wider table there takes the absorbed form."""
    monkeypatch.setattr(pf, "FORM", "auto")
    q, kv, pe, table, idx, w, scale = prefill_case(B=1, T=30, K=36, contexts=(30,))  # 9 blocks of 4
    assert table.shape[1] * kv.shape[1] <= idx.shape[-1]
    calls, attend, absorbed = [], pa.attend, mp.sparse_mla_prefill_absorbed
    monkeypatch.setattr(pa, "attend", lambda *a: calls.append("union") or attend(*a))
    monkeypatch.setattr(mp, "sparse_mla_prefill_absorbed", lambda *a, **k: calls.append("absorbed") or absorbed(*a, **k))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda *a: pytest.fail("a count was read back"))
    with pf.sync_free():
        got = mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale)
        mp.sparse_mla_prefill(q, kv, pe, table, idx[..., :table.shape[1] * kv.shape[1] - 1], w, scale)
    assert calls == ["union", "absorbed"]
    torch.testing.assert_close(got, sparse_mla_prefill_ref(q, kv, pe, table, idx, w, scale), **FP32_TOL)


def test_int64_offsets_give_the_same_result(monkeypatch):
    """The int64 addressing that tensors of 2^31 elements take, forced on a small case: bitwise the same."""
    monkeypatch.setattr(pf, "FORM", "union")
    q, kv, pe, table, idx, w, scale = prefill_case(B=1, T=20, contexts=(20,))
    want = mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale)
    monkeypatch.setattr(pa, "INT32_OFFSETS_BELOW", 0)
    assert torch.equal(mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale), want)


def test_union_form_with_a_missing_block_and_overlapping_selections(monkeypatch):
    """Neighbouring queries share most positions (the case the union form is for), and one block of the
    table is -1: its positions are padding, as in the reference."""
    monkeypatch.setattr(pf, "FORM", "union")
    q, kv, pe, table, idx, w, scale = prefill_case(B=1, T=40, K=12, contexts=(40,), seed=7)
    shared = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:12].int().to(idx.device)
    idx[0, 20:] = shared  # queries 20.. select the same 12 positions
    idx[0, 30:, :3] = -1
    table[0, 2] = -1  # positions 8..11 lose their block
    kv, pe = torch.nan_to_num(kv), torch.nan_to_num(pe)
    out = mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale)
    torch.testing.assert_close(out, sparse_mla_prefill_ref(q, kv, pe, table, idx, w, scale), **FP32_TOL)


def test_tile_unions_and_masks_list_exactly_the_selections():
    """Bit rows, union lists, counts, mask offsets and the masks, against Python sets of the valid
    selections."""
    _, _, _, table, idx, _, _ = prefill_case(K=20, contexts=(130, 90))  # unions past one 64-slot step
    table[0, 1] = -1  # positions 4..7 of sequence 0 lose their block: selected there, but not valid
    bs, (B, T, K), BM = 4, idx.shape, 16
    S = table.shape[1] * bs  # the op's S
    assert ((idx[0] >= 4) & (idx[0] < 8)).any()
    bits, n_valid = pu.bitmaps(idx, table, bs, B, T, S, on_gpu=False)
    union, count, off, stats = pu.tile_unions(bits, n_valid, B, T, S, BM, on_gpu=False)
    pairs, selected, total = stats.tolist()
    words = [(int(c) + 31) // 32 * BM for c in count.view(-1)]  # BM words per 32 union slots
    assert off.tolist() == [sum(words[:i]) for i in range(len(words))] and total == sum(words)
    valid = paged_kv_slots(table, idx.reshape(B, -1), bs).view(B, T, K) >= 0
    assert n_valid.tolist() == valid.sum(-1).view(-1).tolist() and selected == int(valid.sum())
    sel = [[set(idx[b, t][valid[b, t]].tolist()) for t in range(T)] for b in range(B)]
    for b, t in [(0, 0), (0, T - 1), (B - 1, T // 2)]:
        got_bits = {32 * w + j for w, word in enumerate(bits[b * T + t].tolist()) for j in range(32) if word >> j & 1}
        assert got_bits == sel[b][t]
    assert pairs == sum(int(count[b, i]) * len(range(i * BM, min(T, (i + 1) * BM)))
                        for b in range(B) for i in range(count.shape[1]))
    mask = pu.tile_masks(bits, union, count, off, total, T, BM, on_gpu=False)
    assert max(count.view(-1).tolist()) > 64  # more than one step of the CPU kernel's 64 slots
    for b in range(B):
        for tile in range(union.shape[1]):
            i, n = b * union.shape[1] + tile, int(count[b, tile])
            rows = range(tile * BM, min(T, (tile + 1) * BM))
            want = sorted(set().union(*(sel[b][t] for t in rows)))
            assert union[b, tile, :n].tolist() == want
            m = mask[int(off[i]): int(off[i] + words[i])].view(-1, BM).t()  # [BM, chunks]: chunk-major in memory
            slots = [[c * 32 + j for c, w in enumerate(row) for j in range(32) if w >> j & 1] for row in m.tolist()]
            for row, t in enumerate(rows):
                assert slots[row] == [want.index(p) for p in sorted(sel[b][t])]  # nothing past count
            assert all(not r for r in slots[len(rows):])  # rows past T: zeros


def test_forms_are_chosen_by_the_pair_ratio(monkeypatch):
    monkeypatch.setattr(pf, "FORM", "auto")
    for heads in (1, 16, 32, 64, 96):
        ratio = pf.union_break_even(heads)
        assert pf.use_union_form(ratio * 1e6 - 1, 10 ** 6, heads)
        assert not pf.use_union_form(ratio * 1e6 + 1, 10 ** 6, heads)
    assert pf.union_break_even(4) == pf.union_break_even(16)  # not extrapolated below the measured 16 heads
    # The faster form measured on the H200 (T = 32k, top-k 2048, K3 dims, bf16; each form forced), as
    # (heads, union pairs per selected pair, union form faster), leaving out the one case within 5 %.
    measured = [(16, 8.29, True), (16, 1.45, True), (32, 8.29, False), (32, 3.83, True), (64, 8.29, False),
                (64, 3.83, False), (64, 2.26, True), (96, 8.29, False), (96, 2.26, True), (96, 1.45, True)]
    for heads, ratio, union_faster in measured:
        assert pf.use_union_form(ratio * 1e6, 10 ** 6, heads) == union_faster, (heads, ratio)
    monkeypatch.setattr(pf, "FORM", "absorbed")
    assert not pf.use_union_form(0, 100)
    monkeypatch.setattr(pf, "FORM", "dense")
    with pytest.raises(ValueError, match="'dense'"):
        pf.use_union_form(0, 100)


def test_auto_form_follows_the_union_size(monkeypatch):
    """Independent picks (a tile's union is ~12 x top-k here) take the absorbed form, picks that every
    query shares (union = top-k) the union form; each form is then the only one that runs."""
    monkeypatch.setattr(pf, "FORM", "auto")
    q, kv, pe, table, idx, w, scale = prefill_case(B=1, T=64, K=2, contexts=(64,), seed=2)
    idx[0, :, 0] = torch.arange(64, device=idx.device)  # query t picks itself and one random earlier position
    shared = idx.clone()
    shared[0, :] = torch.tensor([3, 7], dtype=torch.int32, device=idx.device)
    calls = []
    monkeypatch.setattr(pa, "attend", lambda *a: calls.append("union"))
    monkeypatch.setattr(mp, "sparse_mla_prefill_absorbed", lambda *a, **k: calls.append("absorbed"))
    mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale)
    mp.sparse_mla_prefill(q, kv, pe, table, shared, w, scale)
    assert calls == ["absorbed", "union"]


@pytest.mark.slow
def test_a_table_wider_than_the_selections_costs_nothing(monkeypatch):
    """A block table made for a longer sequence (-1 columns past the last block): same output, and the
    decompression covers the selected extent, not the table's reach."""
    monkeypatch.setattr(pf, "FORM", "union")
    q, kv, pe, table, idx, w, scale = prefill_case()
    want = mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale)
    wide = torch.cat([table, torch.full((table.shape[0], 100), -1, dtype=table.dtype, device=table.device)], 1)
    widths, decompress = [], mp._decompress

    def recording(kv_plane, pe_plane, blocks, *rest):
        widths.append(blocks.shape[1])
        return decompress(kv_plane, pe_plane, blocks, *rest)
    monkeypatch.setattr(mp, "_decompress", recording)
    assert torch.equal(mp.sparse_mla_prefill(q, kv, pe, wide, idx, w, scale), want)
    assert widths == [-(-(int(idx.max()) + 1) // kv.shape[1])]


def test_empty_and_all_padding_give_zeros():
    q, kv, pe, table, idx, w, scale = prefill_case(B=1, T=5, contexts=(5,))
    out = mp.sparse_mla_prefill(q, kv, pe, table, torch.full_like(idx, -1), w, scale)
    assert out.shape == (1, 5, 3, 10) and (out == 0).all()
    out = mp.sparse_mla_prefill(q[:, :0], kv, pe, table, idx[:, :0], w, scale)
    assert out.shape == (1, 0, 3, 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is only meaningful compiled on a GPU")
@pytest.mark.parametrize("form", ["union", "absorbed"])
def test_bf16_at_the_real_widths_on_gpu(form, monkeypatch):
    """r=512, dr=64, dn=dv=128, 16 heads, bf16. Both forms round q and p to bf16 for the tensor cores where
    the reference works in fp32 on the same bf16 k, v: 3% of the output scale (as for the decode kernel)."""
    monkeypatch.setattr(pf, "FORM", form)
    dev = "cuda"
    B, T, H, r, dr, dn, dv, K, bs = 2, 300, 16, 512, 64, 128, 128, 200, 64
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[1000, 301], dtype=torch.bfloat16, device=dev,
                                    seed=6)
    q = torch.randn(B, T, H, dn + dr, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(H * (dn + dv), r, device=dev) / math.sqrt(r)).bfloat16()
    scale = (dn + dr) ** -0.5
    out = mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale)
    ref = sparse_mla_prefill_ref(q, kv, pe, table, idx, w, scale)
    torch.testing.assert_close(out, ref, atol=3e-2 * float(ref.abs().max()), rtol=3e-2)
    assert torch.equal(out, mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale))
    out32 = mp.sparse_mla_prefill(q.float(), kv.float(), pe.float(), table, idx, w.float(), scale)
    ref32 = sparse_mla_prefill_ref(q.float(), kv.float(), pe.float(), table, idx, w.float(), scale)
    torch.testing.assert_close(out32, ref32, **FP32_TOL)
