"""Kimi Delta Attention: the chunked form against the recurrence, and both against a loop written
here from docs/design.md §5; the layer's prefill -> decode state handoff in the full hybrid model."""

import pytest
import torch
from conftest import tiny_config

import minidsa
from minidsa import ops
from minidsa.ops import causal_conv
from minidsa.ops.kda.chunk_cpu import FACTOR_SPAN
from minidsa.ops.kda.reference import kda_chunk_ref, kda_recurrent_ref


def naive_kda(q, k, v, g, beta, scale, s0):
    """Per batch, head and step, in fp64, straight from the recurrence."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    S_out = torch.zeros(B, H, K, V, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = s0[b, h].double().clone() if s0 is not None else torch.zeros(K, V, dtype=torch.float64)
            for t in range(T):
                S = torch.diag(g[b, t, h].double().exp()) @ S
                u = v[b, t, h].double() - S.T @ k[b, t, h].double()
                S = S + beta[b, t, h].double() * torch.outer(k[b, t, h].double(), u)
                o[b, t, h] = S.T @ (q[b, t, h].double() * scale)
            S_out[b, h] = S
    return o, S_out


def inputs(B, T, H, K, V, gate="mixed", dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    x = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    if gate == "lower_bound":  # alpha ~ e^-5: the state forgets almost everything each step
        g = -5.0 * torch.sigmoid(8.0 + x)
    elif gate == "near_zero":  # alpha ~ 1: almost no decay, the state accumulates over the whole sequence
        g = -5.0 * torch.sigmoid(-12.0 + x)
    else:
        g = -5.0 * torch.sigmoid(x)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("gate", ["mixed", "lower_bound", "near_zero"])
def test_chunk_equals_recurrent_fp64(T, with_state, gate):
    B, H, K, V = 2, 2, 8, 6
    q, k, v, g, beta = inputs(B, T, H, K, V, gate)
    s0 = torch.randn(B, H, K, V, dtype=torch.float64) if with_state else None
    o_r, s_r = ops.kda_recurrent(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = ops.kda_chunk(q, k, v, g, beta, initial_state=s0, chunk_size=64)
    assert o_r.dtype == torch.float64 and s_r.dtype == torch.float64
    # fp64 sums of <= 200 terms of size O(1..10): rounding ~1e-14; 1e-10 leaves four orders of margin.
    torch.testing.assert_close(o_c, o_r, atol=1e-10, rtol=0)
    torch.testing.assert_close(s_c, s_r, atol=1e-10, rtol=0)


def test_recurrent_matches_the_definition():
    q, k, v, g, beta = inputs(2, 11, 3, 5, 4)
    s0 = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    o, s = ops.kda_recurrent(q, k, v, g, beta, scale=0.7, initial_state=s0)
    o_ref, s_ref = naive_kda(q, k, v, g, beta, 0.7, s0)
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=0)
    # default scale is K^-0.5
    o_default, _ = ops.kda_recurrent(q, k, v, g, beta)
    torch.testing.assert_close(o_default, naive_kda(q, k, v, g, beta, 5 ** -0.5, None)[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 7, 16])
def test_chunk_sizes_odd_shapes_fp32(chunk_size):
    """fp32, T=63, K=V=60 (odd shapes): both forms track the fp64 definition."""
    q, k, v, g, beta = inputs(1, 63, 2, 60, 60, dtype=torch.float32)
    o_ref, s_ref = naive_kda(q, k, v, g, beta, 60 ** -0.5, None)
    o_c, s_c = ops.kda_chunk(q, k, v, g, beta, chunk_size=chunk_size)
    o_r, s_r = ops.kda_recurrent(q, k, v, g, beta)
    assert o_c.dtype == torch.float32 and s_c.dtype == torch.float32
    # fp32 state updates over 63 steps with |S| ~ 1-10: relative error ~1e-6; 1e-4 absolute is ~100x that.
    for o, s in [(o_c, s_c), (o_r, s_r)]:
        torch.testing.assert_close(o.double(), o_ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(s.double(), s_ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("decay", [-5.0, -20.0])
def test_sub_chunk_factor_and_pairwise_forms_fp32(decay):
    """Decays at the model's floor (-5 a step: a 16-step sub-chunk spans up to 75, the factored matmul
    form) and far below it (-20: spans of 300 would overflow the factors, so the pairwise form runs):
    both track the fp64 definition in fp32."""
    q, k, v, g, beta = inputs(1, 64, 2, 8, 8, gate="lower_bound", dtype=torch.float32)
    g = g * (decay / -5.0)
    span = float((g[:, :16].sum(1) - g[:, :1].sum(1)).abs().max())
    assert (span > FACTOR_SPAN[torch.float32]) == (decay < -5.0), span  # each case takes the path it names
    o_ref, s_ref = naive_kda(q, k, v, g, beta, 8 ** -0.5, None)
    o_c, s_c = ops.kda_chunk(q, k, v, g, beta, chunk_size=64)
    # As test_chunk_sizes_odd_shapes_fp32: fp32 rounding ~1e-6 relative on values of size ~1-10.
    torch.testing.assert_close(o_c.double(), o_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(s_c.double(), s_ref, atol=1e-4, rtol=0)


def test_grouped_value_heads():
    q, k, _, _, _ = inputs(1, 9, 2, 4, 3)
    _, _, v, g, beta = inputs(1, 9, 4, 4, 3, seed=1)
    o, s = ops.kda_chunk(q, k, v, g, beta, chunk_size=4)
    o_ref, s_ref = naive_kda(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta, 0.5, None)
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=0)


def test_kept_states_are_the_states_of_the_prefixes():
    """``state_at``: the state after a row's first t tokens equals the final state of that prefix run alone (fp64,
    T = 70 with chunk 16: a partial last chunk; pairs out of order, t = 0, t = T and a padding pair)."""
    B, T, H, K, V = 3, 70, 2, 8, 6
    q, k, v, g, beta = inputs(B, T, H, K, V)
    s0 = torch.randn(B, H, K, V, dtype=torch.float64)
    pairs = [(2, 32), (0, 16), (-1, 48), (1, 70), (0, 64), (1, 0)]
    o, s, kept = ops.kda_chunk(q, k, v, g, beta, None, s0, 16, torch.tensor(pairs))
    assert kept.shape == (len(pairs), H, K, V) and kept.dtype == torch.float64
    o_plain, s_plain = ops.kda_chunk(q, k, v, g, beta, None, s0, 16)
    assert torch.equal(o, o_plain) and torch.equal(s, s_plain)  # asking for states changes nothing else
    for m, (row, t) in enumerate(pairs):
        if row < 0:
            assert not kept[m].any()
            continue
        _, want = kda_recurrent_ref(*(x[row:row + 1, :t] for x in (q, k, v, g, beta)), None, s0[row:row + 1])
        torch.testing.assert_close(kept[m], want[0], atol=1e-10, rtol=0)  # as test_chunk_equals_recurrent_fp64


def test_lengths_skip_the_padding_and_equal_each_row_alone():
    """``lengths``: a padded batch whose rows end at 70, 16, 0 and 33 tokens (chunk 16): each row's o and state
    equal the row run alone on its real tokens, o is 0 on the padding whatever it holds, and a kept state
    at a row's end is its final state (fp64, as test_chunk_equals_recurrent_fp64)."""
    B, T, H, K, V = 4, 70, 2, 8, 6
    q, k, v, g, beta = inputs(B, T, H, K, V)
    s0 = torch.randn(B, H, K, V, dtype=torch.float64)
    lengths = torch.tensor([70, 16, 0, 33])
    o, s, kept = ops.kda_chunk(q, k, v, g, beta, None, s0, 16, torch.tensor([(1, 16), (3, 32)]), lengths)
    for b, n in enumerate(lengths.tolist()):
        o_b, s_b = kda_recurrent_ref(*(x[b:b + 1, :n] for x in (q, k, v, g, beta)), None, s0[b:b + 1])
        torch.testing.assert_close(o[b:b + 1, :n], o_b, atol=1e-10, rtol=0)
        torch.testing.assert_close(s[b:b + 1], s_b, atol=1e-10, rtol=0)
        assert not o[b, n:].any()
    torch.testing.assert_close(kept[0], s[1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="lengths must lie in"):
        ops.kda_chunk(q, k, v, g, beta, lengths=torch.tensor([71, 0, 0, 0]))


def test_kept_state_positions_are_checked():
    q, k, v, g, beta = inputs(2, 40, 1, 4, 3)
    for pairs, match in (([(0, 8)], "multiple of chunk_size"), ([(2, 16)], "row < 2"), ([(0, 48)], "in \\[0, 40\\]"),
                         ([(0, 16), (0, 16)], "twice")):
        with pytest.raises(ValueError, match=match):
            ops.kda_chunk(q, k, v, g, beta, None, None, 16, torch.tensor(pairs))
    with pytest.raises(ValueError, match="\\[M, 2\\]"):
        ops.kda_chunk(q, k, v, g, beta, None, None, 16, torch.tensor([[0, 16, 1]]))


def test_bad_inputs_name_the_tensor():
    q, k, v, g, beta = inputs(1, 4, 2, 4, 3)
    with pytest.raises(ValueError, match="k has shape"):
        ops.kda_recurrent(q, k[:, :3], v, g, beta)
    with pytest.raises(ValueError, match="g has shape"):
        ops.kda_chunk(q, k, v, g[..., :3], beta)
    with pytest.raises(ValueError, match="beta"):
        ops.kda_chunk(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        ops.kda_chunk(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 4, 4))
    with pytest.raises(TypeError, match="v must be a floating"):
        ops.kda_recurrent(q, k, v.long(), g, beta)
    with pytest.raises(ValueError, match="v has 3 heads"):
        ops.kda_recurrent(q, k, torch.randn(1, 4, 3, 3), torch.randn(1, 4, 3, 4), torch.rand(1, 4, 3))
    with pytest.raises(ValueError, match="chunk_size"):
        ops.kda_chunk(q, k, v, g, beta, chunk_size=0)


def test_causal_conv_continues_across_calls():
    x = torch.randn(2, 10, 5)
    w = torch.randn(5, 1, 4)
    full, _ = causal_conv(x, w, torch.zeros(2, 3, 5))
    ref = torch.nn.functional.conv1d(x.transpose(1, 2), w, padding=3, groups=5)[..., :10].transpose(1, 2)
    torch.testing.assert_close(full, ref)
    state, parts = torch.zeros(2, 3, 5), []
    for lo, hi in [(0, 1), (1, 3), (3, 4), (4, 10)]:  # pieces shorter than the kernel too
        y, state = causal_conv(x[:, lo:hi], w, state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, 1), full)
    torch.testing.assert_close(state, x[:, -3:])


# ------------------------------------------------------------------ the layer in the hybrid model
def test_hybrid_pattern_in_presets():
    for name in ("tiny", "laptop", "small"):
        cfg = minidsa.load_config(name)
        n = cfg.num_layers
        assert cfg.layer_types == ["mla" if (i % 4 == 3 or i == n - 1) else "kda" for i in range(n)]


@pytest.mark.parametrize("n", [16, 21, 32, 1])  # tiny: chunk 16 -> on a boundary, mid-chunk, two chunks, one token
def test_prefill_then_decode_equals_one_forward(n):
    model = minidsa.MiniDSA(tiny_config(dtype="float64"))
    m = 9
    ids = torch.stack([torch.randperm(256)[: n + m]])
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        sid = cache.add_sequence()
        outs = [model(ids[:, :n], cache=cache, seq_ids=[sid])]
        outs += [model(ids[:, t: t + 1], cache=cache, seq_ids=[sid]) for t in range(n, n + m)]
    # fp64 throughout: the chunked and recurrent forms differ only by rounding (~1e-15).
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-11, rtol=0)


def test_kda_state_is_fp32_in_a_bf16_model():
    model = minidsa.MiniDSA(tiny_config(dtype="bfloat16"))
    cache = model.new_cache()
    assert all(t.dtype == torch.float32 for layer in cache.state for t in layer.values())
    sid = cache.add_sequence()
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (1, 20)), cache=cache, seq_ids=[sid])
        step = model(torch.tensor([[3]]), cache=cache, seq_ids=[sid])
    assert torch.isfinite(logits).all() and torch.isfinite(step).all()


def test_failed_forward_leaves_kda_state_untouched(monkeypatch):
    model = minidsa.MiniDSA(tiny_config(dtype="float64"))
    cache = model.new_cache()
    sid = cache.add_sequence()
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        model(ids[:, :10], cache=cache, seq_ids=[sid])
        snapshot = [{n: t.clone() for n, t in layer.items()} for layer in cache.state]
        last = model.language_model.model.layers[-1].self_attn
        monkeypatch.setattr(last, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            model(ids[:, 10:11], cache=cache, seq_ids=[sid])
        monkeypatch.undo()
        for before, after in zip(snapshot, cache.state):
            for n in before:
                assert torch.equal(before[n], after[n]), n
        assert cache.seq_len(sid) == 10
        resumed = torch.cat([model(ids[:, 10:11], cache=cache, seq_ids=[sid]),
                             model(ids[:, 11:12], cache=cache, seq_ids=[sid])], 1)
        torch.testing.assert_close(resumed, model(ids)[:, 10:], atol=1e-11, rtol=0)


@pytest.mark.parametrize("fn", [kda_recurrent_ref, kda_chunk_ref], ids=["recurrent", "chunk"])
def test_empty_sequence_returns_a_copy_of_the_state(fn):
    """T = 0: no output rows, and the state passes through as a new tensor (never the caller's own)."""
    s0 = torch.randn(1, 2, 4, 3)
    z = torch.zeros(1, 0, 2, 4)
    o, s = fn(z, z, torch.zeros(1, 0, 2, 3), z, torch.zeros(1, 0, 2), None, s0)[:2]
    assert o.shape == (1, 0, 2, 3) and torch.equal(s, s0) and s.data_ptr() != s0.data_ptr()
