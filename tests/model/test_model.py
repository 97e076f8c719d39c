"""Every cached path equals the plain no-cache forward, and each attention path equals the
masked-dense reference built here from the layer's own projections."""

import pytest
import torch
from conftest import tiny_config, with_indexer

import minidsa
from minidsa import ops
from minidsa.model.mla import GatedMLA

# fp32: the cached paths compute the same function in another order (absorbed vs decompressed
# attention, block gathers, different matmul shapes), so logits (|x| ~ 0.1-1) differ by rounding:
# observed <= 3e-7 over 4 layers. 2e-5 leaves ~50x headroom; one wrongly selected key moves logits by
# more than 1e-3 (checked in test_wrong_selection_is_detectable), so the check can still fail.
FP32_TOL = 2e-5
FP64_TOL = 1e-12  # same paths in fp64: rounding ~1e-16 per op


def make_model(dtype="float32", **indexer):
    cfg = tiny_config(dtype=dtype)
    if indexer:
        cfg = with_indexer(cfg, **indexer)
    return minidsa.MiniDSA(cfg)


def incremental(model, ids, prompt_len, cache=None):
    """Prefill ids[:, :prompt_len], then decode one token at a time. Returns logits and traces."""
    cache = cache or model.new_cache()
    sid = cache.add_sequence()
    traces, outs = [], []
    for lo, hi in [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, ids.shape[1])]:
        tr = minidsa.ForwardTrace()
        outs.append(model(ids[:, lo:hi], cache=cache, seq_ids=[sid], trace=tr))
        traces.append(tr)
    sel = {layer: torch.cat([t.selected[layer] for t in traces], dim=1) for layer in traces[0].selected}
    return torch.cat(outs, dim=1), sel, cache, sid


def distinct_tokens(B, T):
    """Token ids without repeats. MLA has no positional encoding, so when the layers below an MLA layer
    carry little context (a random model), a repeated token gets a near-identical indexer key, its
    scores nearly tie and rounding (which differs between paths) may pick the order: docs/design.md §10,
    trap 8. Distinct tokens keep selections comparable."""
    return torch.stack([torch.randperm(256)[:T] for _ in range(B)])


def same_sets(a, b):
    return torch.equal(a.sort(-1).values, b.sort(-1).values)


# tiny: topk 8, kv_block_size 8. Prompts below, equal to and above top-k; decode crosses blocks.
@pytest.mark.parametrize("prompt_len", [1, 5, 8, 9, 15, 16, 17])
def test_incremental_decode_equals_full_forward_fp32(prompt_len):
    model = make_model()
    ids = distinct_tokens(1, 34)
    with torch.no_grad():
        full_trace = minidsa.ForwardTrace()
        full = model(ids, trace=full_trace)
        inc, sel, _, _ = incremental(model, ids, prompt_len)
    torch.testing.assert_close(inc, full, atol=FP32_TOL, rtol=0)
    for layer in full_trace.selected:
        assert same_sets(sel[layer], full_trace.selected[layer]), f"layer {layer} selected other keys"


@pytest.mark.parametrize("prompt_len", [3, 8, 13])
@pytest.mark.parametrize("fp8", [False, True])
def test_incremental_decode_equals_full_forward_fp64(prompt_len, fp8):
    model = make_model("float64", fp8=fp8, hadamard=fp8)
    ids = distinct_tokens(2, 27)
    with torch.no_grad():
        full_trace = minidsa.ForwardTrace()
        full = model(ids, trace=full_trace)
        for b in range(2):
            inc, sel, _, _ = incremental(model, ids[b: b + 1], prompt_len)
            torch.testing.assert_close(inc, full[b: b + 1], atol=FP64_TOL, rtol=0)
            for layer in full_trace.selected:  # fp64 and no ties: the same keys in the same order
                assert torch.equal(sel[layer], full_trace.selected[layer][b: b + 1])


def test_repeated_tokens_still_give_equal_logits():
    """Near-tied scores (repeated tokens) may be ordered differently by the two paths; the logits
    must still agree."""
    model = make_model()
    ids = torch.randint(0, 16, (1, 40))  # many repeats
    with torch.no_grad():
        full = model(ids)
        inc = incremental(model, ids, 9)[0]
    torch.testing.assert_close(inc, full, atol=FP32_TOL, rtol=0)


def test_sparsity_is_real_and_selection_is_causal():
    model = make_model()
    ids = torch.randint(0, 256, (1, 40))
    tr = minidsa.ForwardTrace()
    with torch.no_grad():
        model(ids, trace=tr)
    topk = model.config.indexer.topk
    assert sorted(tr.selected) == model.config.mla_layers
    for layer, idx in tr.selected.items():
        assert idx.shape == (1, 40, topk)
        pos = torch.arange(40).view(1, 40, 1)
        assert ((idx <= pos) | (idx == -1)).all()
        n_valid = (idx >= 0).sum(-1)
        assert torch.equal(n_valid[0], torch.clamp(torch.arange(40) + 1, max=topk))
        # later queries skip some past keys (otherwise this would be dense attention)
        assert not torch.equal(idx[0, -1].sort().values, torch.arange(32, 40, dtype=torch.int32))


def test_wrong_selection_is_detectable():
    """The tolerance above is tight enough to see a single swapped key."""
    model = make_model()
    ids = torch.randint(0, 256, (1, 30))
    layer0 = model.language_model.model.layers[model.config.mla_layers[0]].self_attn
    with torch.no_grad():
        full = model(ids)
        original = layer0.indexer.select

        def off_by_one(*a, **k):
            idx = original(*a, **k)
            idx[:, -1, 0] = torch.where(idx[:, -1, 0] > 0, idx[:, -1, 0] - 1, idx[:, -1, 0])
            if (idx[:, -1] == idx[:, -1, :1]).sum() > 1:  # keep entries distinct
                idx[:, -1, 0] = -1
            return idx
        layer0.indexer.select = off_by_one
        try:
            perturbed = model(ids)
        finally:
            layer0.indexer.select = original
    assert (perturbed[0, -1] - full[0, -1]).abs().max() > 50 * FP32_TOL


def test_chunked_prefill_and_paged_equals_contiguous():
    """Two prefill chunks into a fragmented cache equal one contiguous forward."""
    model = make_model("float64")
    ids = torch.randint(0, 256, (1, 37))
    cache = model.new_cache()
    other = cache.add_sequence()
    sid = cache.add_sequence()
    with torch.no_grad():
        full = model(ids)
        outs = []
        for lo, hi in [(0, 11), (11, 30), (30, 37)]:
            cache.reserve({other: cache.blocks_needed(other, 0) + len(cache.block_table(other)) * 8 + 8})
            outs.append(model(ids[:, lo:hi], cache=cache, seq_ids=[sid]))
    table = cache.block_table(sid)
    assert table != list(range(table[0], table[0] + len(table))), "blocks must be scattered for this test"
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=FP64_TOL, rtol=0)
    assert cache.seq_len(sid) == 37


def test_batched_decode_of_different_lengths_equals_single():
    model = make_model("float64")
    cache = model.new_cache()
    lens = [5, 12, 20]
    seqs = [torch.randint(0, 256, (1, n + 6)) for n in lens]
    sids = [cache.add_sequence() for _ in lens]
    with torch.no_grad():
        for sid, ids, n in zip(sids, seqs, lens):
            model(ids[:, :n], cache=cache, seq_ids=[sid])
        for step in range(6):
            tok = torch.stack([ids[0, n + step] for ids, n in zip(seqs, lens)]).view(3, 1)
            out = model(tok, cache=cache, seq_ids=sids)
            for b, (ids, n) in enumerate(zip(seqs, lens)):
                ref = model(ids[:, : n + step + 1])[0, -1]
                torch.testing.assert_close(out[b, 0], ref, atol=FP64_TOL, rtol=0)


# ------------------------------------------------------------------ one layer vs masked dense
def layer_reference(mla, x):
    """Dense attention over all causal keys masked to the indexer's selection, from scratch."""
    p = mla._project(x)
    B, T = x.shape[:2]
    k_idx = mla.indexer.dequant_keys(p)
    scores = ops.index_scores(p["q_idx"], k_idx, p["w_idx"], mla.indexer.softmax_scale)
    idx = ops.topk_indices(scores, mla.indexer.topk, torch.arange(T).expand(B, T))
    k, v = mla.decompress(p["kv_latent"], p["k_pe"])
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    mask = ops.indices_to_mask(idx, T) & causal
    o = ops.masked_dense_attention(p["q"], k, v, mask, mla.softmax_scale)
    return mla._finish(o, p["gate"]), idx, p


def cached_layer(mla, x, model, prompt_len):
    cache = model.new_cache()
    sid = cache.add_sequence()
    outs = []
    for lo, hi in [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, x.shape[1])]:
        ctx = cache.prepare([sid], hi - lo, x.device)
        outs.append(mla(x[:, lo:hi], ctx))
        ctx.publish()
    return torch.cat(outs, 1)


def test_sparse_prefill_and_decode_equal_masked_dense_reference():
    model = make_model("float64")
    mla = model.language_model.model.layers[model.config.mla_layers[0]].self_attn
    x = torch.randn(1, 29, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        ref, idx, _ = layer_reference(mla, x)
        assert (ops.indices_to_mask(idx, 29).sum(-1) < torch.arange(1, 30)).any(), "selection must be sparse"
        prefill_only = cached_layer(mla, x, model, 29)
        decode_after_1 = cached_layer(mla, x, model, 1)
        uncached = mla(x)
    torch.testing.assert_close(prefill_only, ref, atol=FP64_TOL, rtol=0)
    torch.testing.assert_close(decode_after_1, ref, atol=FP64_TOL, rtol=0)
    torch.testing.assert_close(uncached, ref, atol=FP64_TOL, rtol=0)


def test_absorbed_decode_equals_decompressed_attention():
    model = make_model("float64")
    mla = model.language_model.model.layers[model.config.mla_layers[1]].self_attn
    B, S = 2, 13
    x = torch.randn(B, 1, model.config.hidden_size, dtype=torch.float64)
    latent = torch.randn(B, S, mla.r, dtype=torch.float64)
    k_pe = torch.randn(B, S, mla.dr, dtype=torch.float64)
    q = mla._project(x)["q"]
    idx = torch.tensor([[[0, 5, 12, -1]], [[3, 2, -1, -1]]], dtype=torch.int32)
    k, v = mla.decompress(latent, k_pe)
    expect = ops.sparse_attention(q, k, v, idx, mla.softmax_scale)
    w_uk, w_uv = mla.absorbed_weights()
    q_lat = torch.einsum("bthn,hnr->bthr", q[..., : mla.dn], w_uk)
    o_lat = ops.sparse_attention(torch.cat([q_lat, q[..., mla.dn:]], -1),
                                 torch.cat([latent, k_pe], -1).unsqueeze(2), latent.unsqueeze(2), idx,
                                 mla.softmax_scale)
    got = torch.einsum("bthr,hvr->bthv", o_lat, w_uv)
    torch.testing.assert_close(got, expect, atol=FP64_TOL, rtol=0)


def test_hadamard_on_both_sides_keeps_the_selection():
    """Trap 1: rotating q_I and k_I together leaves fp64 scores unchanged (no fp8 involved)."""
    from minidsa.formats.fp8 import hadamard
    q, k, w = torch.randn(1, 9, 2, 16, dtype=torch.float64), torch.randn(1, 9, 16, dtype=torch.float64), \
        torch.randn(1, 9, 2, dtype=torch.float64)
    plain = ops.index_scores(q, k, w, 0.25)
    both = ops.index_scores(hadamard(q).double(), hadamard(k).double(), w, 0.25)
    one = ops.index_scores(hadamard(q).double(), k, w, 0.25)
    torch.testing.assert_close(both, plain, atol=1e-5, rtol=1e-5)  # hadamard() computes in fp32
    assert (one - plain).abs().max() > 1e-2


def test_indexer_rotation_survives_checkpoint_style_construction():
    """The rotation's matrix is a buffer outside the checkpoint: a model built on "meta" and moved with
    to_empty (as loading does) must hold the real matrix, and a dtype move must leave it fp32."""
    from minidsa.formats.fp8 import hadamard_matrix
    cfg = with_indexer(tiny_config(), fp8=True, hadamard=True)
    model = minidsa.MiniDSA(cfg, device="meta", init=False).to_empty(device="cpu").to(torch.bfloat16)
    rotations = [m.rotation for m in model.modules() if getattr(m, "rotation", None) is not None]
    assert rotations and all(torch.equal(r, hadamard_matrix(cfg.indexer.head_dim)) for r in rotations)
    assert "rotation" not in " ".join(model.state_dict())


def test_forward_rejects_bad_ids_and_keeps_cache():
    model = make_model()
    cache = model.new_cache(num_blocks=3)
    sid = cache.add_sequence()
    model(torch.randint(0, 256, (1, 10)), cache=cache, seq_ids=[sid])
    with pytest.raises(ValueError, match="outside"):
        model(torch.tensor([[300]]), cache=cache, seq_ids=[sid])
    with pytest.raises(TypeError, match="integer"):
        model(torch.zeros(1, 2))
    with pytest.raises(ValueError, match="seq_ids"):
        model(torch.tensor([[1, 2]]), cache=cache, seq_ids=None)
    with pytest.raises(minidsa.OutOfKVBlocksError):
        model(torch.randint(0, 256, (1, 20)), cache=cache, seq_ids=[sid])
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 257, dtype=torch.long))
    assert cache.seq_len(sid) == 10 and len(cache.block_table(sid)) == 2
    model(torch.tensor([[5]]), cache=cache, seq_ids=[sid])
    assert cache.seq_len(sid) == 11


def test_paged_cache_equals_one_contiguous_block():
    """Small scattered blocks vs one block holding the whole context: bit-for-bit the same math."""
    ids = distinct_tokens(1, 30)
    paged = make_model("float64")
    contiguous = minidsa.MiniDSA(paged.config.replace(kv_block_size=paged.config.max_seq_len, kv_num_blocks=2))
    contiguous.load_state_dict(paged.state_dict())
    with torch.no_grad():
        a, sel_a, cache_a, sid_a = incremental(paged, ids, 11)
        b, sel_b, cache_b, sid_b = incremental(contiguous, ids, 11)
    assert len(cache_a.block_table(sid_a)) == 4 and len(cache_b.block_table(sid_b)) == 1
    torch.testing.assert_close(a, b, atol=FP64_TOL, rtol=0)
    for layer in sel_a:
        assert torch.equal(sel_a[layer], sel_b[layer])


def test_bfloat16_model_runs_every_path():
    """bf16 weights with fp32 norms, gates and states: every path runs and stays finite."""
    import numpy as np
    model = minidsa.MiniDSA(tiny_config(dtype="bfloat16", indexer=minidsa.load_config("tiny").indexer))
    assert model.language_model.lm_head.weight.dtype == torch.bfloat16
    assert model.language_model.model.layers[3].self_attn.indexer.k_norm.weight.dtype == torch.float32
    ids = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        full = model(ids)
        _, _, cache, _ = incremental(model, ids[:1], 20)
    assert full.dtype == torch.float32 and torch.isfinite(full).all()
    img = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    text = minidsa.generate("x", model, images=[img], max_new_tokens=4, temperature=0, stop_at_eos=False)
    assert isinstance(text, str)
    fp8 = minidsa.MiniDSA(with_indexer(tiny_config(dtype="bfloat16"), fp8=True, hadamard=True))
    with torch.no_grad():
        assert torch.isfinite(fp8(ids)).all()


def test_mla_latent_norms_use_the_release_eps(tiny_model):
    """The release builds q_a_layernorm and kv_a_layernorm without an eps (the RMSNorm default, 1e-6), every
    other norm with rms_norm_eps (1e-5). A latent whose mean square is near 1e-6 tells the two apart."""
    mla = next(m for m in tiny_model.modules() if isinstance(m, GatedMLA))
    for norm in (mla.q_a_layernorm, mla.kv_a_layernorm):
        x = torch.full((1, norm.weight.numel()), 1e-3)   # mean square 1e-6
        want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.detach().float()
        torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=0)  # fp32 rounding of one division
    assert tiny_model.config.rms_norm_eps == 1e-5 and mla.indexer.k_norm.eps == tiny_model.config.rms_norm_eps
