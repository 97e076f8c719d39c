"""Block Attention Residuals (docs/design.md §1): the mixer op and the decoder wiring, both against
naive versions written here."""

import pytest
import torch
from conftest import tiny_config

import minidsa
from minidsa import ops


def naive_mix(sources, w, gamma, eps=1e-5):
    """Explicit loop: score_i = <RMSNorm_gamma(V_i), w>, softmax over i, weighted sum."""
    scores = []
    for v in sources:
        normed = v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * gamma
        scores.append((normed * w).sum(-1))
    alpha = torch.softmax(torch.stack(scores), dim=0)
    return sum(a.unsqueeze(-1) * v for a, v in zip(alpha, sources)), alpha


def test_mix_op_matches_definition():
    sources = torch.randn(5, 2, 3, 16, dtype=torch.float64)
    w, gamma = torch.randn(16, dtype=torch.float64), torch.rand(16, dtype=torch.float64) + 0.5
    out, alpha = ops.attn_res_mix(sources, w, gamma, 1e-5, return_weights=True)
    ref_out, ref_alpha = naive_mix(list(sources), w, gamma)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-12, rtol=0)
    assert alpha.shape == (5, 2, 3)


def test_zero_query_averages():
    sources = torch.randn(4, 7, 8)
    out, alpha = ops.attn_res_mix(sources, torch.zeros(8), torch.ones(8), return_weights=True)
    assert torch.equal(alpha, torch.full((4, 7), 0.25))
    torch.testing.assert_close(out, sources.mean(0), atol=1e-6, rtol=0)  # fp32 mean of 4 values


def test_mix_rejects_bad_shapes():
    with pytest.raises(ValueError, match="query"):
        ops.attn_res_mix(torch.randn(2, 3, 8), torch.zeros(7), torch.ones(8))
    with pytest.raises(ValueError, match="norm_weight"):
        ops.attn_res_mix(torch.randn(2, 3, 8), torch.zeros(8), torch.ones(8, 1))
    with pytest.raises(ValueError, match="sources"):
        ops.attn_res_mix(torch.randn(8), torch.zeros(8), torch.ones(8))
    with pytest.raises(TypeError, match="sources"):
        ops.attn_res_mix(torch.ones(2, 8, dtype=torch.long), torch.zeros(8), torch.ones(8))


def naive_decoder_logits(model, ids):
    """docs/design.md §1 step by step, with the model's sub-layers and naive_mix; fp64 model."""
    lm = model.language_model
    bs = model.config.attn_res_block_size
    p_in = lm.model.embed_tokens(ids)
    B = []
    for l, layer in enumerate(lm.model.layers):
        w_a, g_a = layer.self_attention_res_proj.weight[0], layer.self_attention_res_norm.weight
        w_f, g_f = layer.mlp_res_proj.weight[0], layer.mlp_res_norm.weight
        h = naive_mix(B + [p_in], w_a, g_a)[0] if B else p_in  # 1.
        if l % bs == 0:  # 2.
            B.append(p_in)
            p = torch.zeros_like(p_in)
        else:
            p = p_in
        p = p + layer.self_attn(layer.input_layernorm(h))  # 3.
        h2 = naive_mix(B + [p], w_f, g_f)[0]  # 4.
        ffn = layer.block_sparse_moe if layer.is_moe else layer.mlp
        p_in = p + ffn(layer.post_attention_layernorm(h2))
    out = naive_mix(B + [p_in], lm.model.output_attn_res_proj.weight[0], lm.model.output_attn_res_norm.weight)[0]
    return lm.lm_head(lm.model.norm(out))


def randomise_queries(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            if name.endswith("res_norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) + 0.5)


@pytest.mark.parametrize("block_size", [1, 2, 3, 100])  # 1 = Full AttnRes; 100 = one block after the embedding
def test_decoder_wiring_matches_spec(block_size):
    model = minidsa.MiniDSA(tiny_config(dtype="float64", attn_res_block_size=block_size))
    randomise_queries(model)
    ids = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        got = model(ids)
        ref = naive_decoder_logits(model, ids)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)


def test_full_attn_res_sources_with_block_size_one():
    """Block size 1: every layer's output is its own source, so layer l's attention mixer sees
    l + 1 sources (embedding and the l previous layers) and the output mixer L + 1."""
    model = minidsa.MiniDSA(tiny_config(attn_res_block_size=1))
    tr = minidsa.ForwardTrace()
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 5)), trace=tr)
    L = model.config.num_layers
    for l in range(1, L):
        assert tr.depth_weights[f"{l}.attn"].shape[0] == l + 1
        assert tr.depth_weights[f"{l}.ffn"].shape[0] == l + 2
    assert tr.depth_weights["out"].shape[0] == L + 1


def test_fresh_model_averages_its_sources():
    model = minidsa.load("tiny")
    tr = minidsa.ForwardTrace()
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 6)), trace=tr)
    assert "0.attn" not in tr.depth_weights  # layer 0 reads the embedding directly
    for name, alpha in tr.depth_weights.items():
        n = alpha.shape[0]
        assert torch.equal(alpha, torch.full_like(alpha, 1.0 / n)), name


def test_generate_trace_records_depth_weights(tiny_model):
    trace = minidsa.generate("abc", tiny_model, max_new_tokens=4, temperature=0, trace=True,
                             stop_at_eos=False).trace
    n = len(trace.token_ids)
    assert set(trace.depth_weights) >= {"1.attn", "0.ffn", "out"}
    out = trace.depth_weights["out"]
    assert out.shape[0] == n and torch.allclose(out.sum(-1), torch.ones(n))


@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_two_phase_inference_is_exact(block_size):
    """docs/design.md §1's optional schedule: batch-score a block's mixers, merge partial sums online."""
    cfg = tiny_config(dtype="float64", attn_res_block_size=block_size)
    seq = minidsa.MiniDSA(cfg)
    randomise_queries(seq)
    two = minidsa.MiniDSA(cfg.replace(attn_res_two_phase=True))
    two.load_state_dict(seq.state_dict())
    ids = torch.randint(0, 256, (2, 13))
    ta, tb = minidsa.ForwardTrace(), minidsa.ForwardTrace()
    with torch.no_grad():
        a, b = seq(ids, trace=ta), two(ids, trace=tb)
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
        cache = two.new_cache()
        sid = cache.add_sequence()
        steps = [two(ids[:1, :9], cache=cache, seq_ids=[sid])] + \
            [two(ids[:1, t: t + 1], cache=cache, seq_ids=[sid]) for t in range(9, 13)]
    torch.testing.assert_close(torch.cat(steps, 1), a[:1], atol=1e-11, rtol=0)
    assert ta.depth_weights.keys() == tb.depth_weights.keys()
    for name in ta.depth_weights:
        torch.testing.assert_close(tb.depth_weights[name], ta.depth_weights[name], atol=1e-12, rtol=0)


def test_two_phase_ops_match_the_mixer():
    blocks = torch.randn(3, 2, 5, 16, dtype=torch.float64)
    partial = torch.randn(2, 5, 16, dtype=torch.float64)
    q, g = torch.randn(4, 16, dtype=torch.float64), torch.rand(4, 16, dtype=torch.float64) + 0.5
    scores = ops.attn_res_block_scores(blocks, q, g)
    assert scores.shape == (4, 3, 2, 5)
    for j in range(4):
        out, w = ops.attn_res_merge(blocks, scores[j], partial, q[j], g[j], return_weights=True)
        ref, ref_w = naive_mix(list(blocks) + [partial], q[j], g[j])
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(w, ref_w, atol=1e-12, rtol=0)
