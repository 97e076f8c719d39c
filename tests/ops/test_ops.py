"""Reference ops against independent brute-force implementations written here in loops."""


import pytest
import torch

from minidsa import ops
from minidsa.formats.fp8 import FP8_E4M3_MAX, dequantize_fp8, hadamard, quantize_fp8_pow2


# ------------------------------------------------------------------ index_scores
def naive_index_scores(q, k, w, scale):
    B, T, H, _ = q.shape
    S = k.shape[1]
    out = torch.zeros(B, T, S, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for s in range(S):
                out[b, t, s] = sum(float(w[b, t, h]) * max(0.0, scale * float(q[b, t, h] @ k[b, s]))
                                   for h in range(H))
    return out


def test_index_scores_matches_per_head_relu():
    B, T, S, H, D = 2, 5, 7, 3, 6
    q, k = torch.randn(B, T, H, D), torch.randn(B, S, D)
    w = torch.randn(B, T, H)  # signed: ReLU of the weighted sum would differ
    got = ops.index_scores(q, k, w, D ** -0.5)
    assert got.dtype == torch.float32 and got.shape == (B, T, S)
    ref = naive_index_scores(q.double(), k.double(), w.double(), D ** -0.5)
    # fp32 dot products of length 6 and a 3-term sum: a few ulps of values O(1).
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    wrong = (w.unsqueeze(-1) * torch.einsum("bthd,bsd->bths", q, k) * D ** -0.5).sum(2).relu()
    assert (got - wrong).abs().max() > 1e-2


def test_index_scores_odd_shapes_fp64():
    B, T, S, H, D = 1, 63, 63, 5, 60
    q, k, w = torch.randn(B, T, H, D, dtype=torch.float64), torch.randn(B, S, D, dtype=torch.float64), \
        torch.randn(B, T, H, dtype=torch.float64)
    got = ops.index_scores(q, k, w, 0.1, backend="torch")
    ref = (w.unsqueeze(-1) * (0.1 * torch.einsum("bthd,bsd->bths", q, k)).relu()).sum(2)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


def test_index_scores_bad_shapes_name_the_tensor():
    q, k, w = torch.randn(1, 2, 3, 4), torch.randn(1, 5, 4), torch.randn(1, 2, 3)
    with pytest.raises(ValueError, match="k has shape"):
        ops.index_scores(q, torch.randn(1, 5, 3), w, 1.0)
    with pytest.raises(ValueError, match="w has shape"):
        ops.index_scores(q, k, torch.randn(1, 2, 2), 1.0)
    with pytest.raises(TypeError, match="q must be"):
        ops.index_scores(q.long(), k, w, 1.0)


# ------------------------------------------------------------------ topk_indices
def brute_topk(scores, topk, q_pos):
    B, T, S = scores.shape
    out = torch.full((B, T, topk), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            cands = [s for s in range(S) if s <= int(q_pos[b, t])]
            cands.sort(key=lambda s: (-float(scores[b, t, s]), s))
            for j, s in enumerate(cands[:topk]):
                out[b, t, j] = s
    return out


@pytest.mark.parametrize("S, topk", [(1, 1), (1, 4), (5, 8), (8, 8), (13, 8), (63, 16)])
def test_topk_matches_brute_force(S, topk):
    B, T = 2, S
    scores = torch.randn(B, T, S, dtype=torch.float64)
    q_pos = torch.arange(T).expand(B, T)
    got = ops.topk_indices(scores, topk, q_pos)
    assert got.dtype == torch.int32 and got.shape == (B, T, topk)
    assert torch.equal(got, brute_topk(scores, topk, q_pos))


def test_topk_short_sequence_pads_with_minus_one_never_future():
    scores = torch.tensor([[[0.0, 5.0, 9.0, 1.0]]])  # future positions score highest
    got = ops.topk_indices(scores, 3, torch.tensor([[1]]))
    assert got.tolist() == [[[1, 0, -1]]]


def test_topk_single_token_and_exactly_k():
    assert ops.topk_indices(torch.zeros(1, 1, 1), 4, torch.tensor([[0]])).tolist() == [[[0, -1, -1, -1]]]
    got = ops.topk_indices(torch.randn(1, 1, 4), 4, torch.tensor([[3]]))
    assert sorted(got[0, 0].tolist()) == [0, 1, 2, 3]


def test_topk_ties_prefer_lower_position():
    scores = torch.tensor([[[1.0, 2.0, 2.0, 1.0, 2.0, 1.0]]])
    got = ops.topk_indices(scores, 4, torch.tensor([[5]]))
    assert got.tolist() == [[[1, 2, 4, 0]]]
    # All equal (e.g. a fresh indexer): the earliest positions win, in order.
    assert ops.topk_indices(torch.zeros(1, 1, 6), 3, torch.tensor([[5]])).tolist() == [[[0, 1, 2]]]


def test_topk_candidate_scored_minus_inf_is_still_before_padding():
    scores = torch.tensor([[[float("-inf"), 1.0, 3.0]]])
    assert ops.topk_indices(scores, 3, torch.tensor([[1]])).tolist() == [[[1, 0, -1]]]


def test_topk_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        ops.topk_indices(torch.tensor([[[float("nan"), 1.0]]]), 1, torch.tensor([[1]]))
    with pytest.raises(ValueError, match="topk"):
        ops.topk_indices(torch.zeros(1, 1, 2), 0, torch.tensor([[1]]))
    with pytest.raises(ValueError, match="q_pos"):
        ops.topk_indices(torch.zeros(1, 2, 2), 1, torch.tensor([[1]]))
    with pytest.raises(TypeError, match="q_pos"):
        ops.topk_indices(torch.zeros(1, 1, 2), 1, torch.tensor([[1.0]]))


# ------------------------------------------------------------------ sparse_attention
def random_indices(B, T, S, K, causal=True):
    """Distinct valid positions (<= t when causal), -1 padded at the end, shuffled order."""
    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            n_cand = min(t + 1, S) if causal else S
            n = int(torch.randint(0, min(K, n_cand) + 1, ()))
            idx[b, t, :n] = torch.randperm(n_cand)[:n].int()
    return idx


@pytest.mark.parametrize("Hkv", [1, 5])
def test_sparse_attention_equals_masked_dense_odd_shapes(Hkv):
    B, T, S, H, D, Dv, K = 2, 63, 63, 5, 60, 36, 16
    q = torch.randn(B, T, H, D, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, D, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, Dv, dtype=torch.float64)
    idx = random_indices(B, T, S, K)
    got = ops.sparse_attention(q, k, v, idx, D ** -0.5)
    ref = ops.masked_dense_attention(q, k, v, ops.indices_to_mask(idx, S), D ** -0.5)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    # and against a loop written from the definition
    b, t, h = 1, 40, 3
    sel = [int(s) for s in idx[b, t] if s >= 0]
    if sel:
        hk = h if Hkv > 1 else 0
        logits = torch.stack([q[b, t, h] @ k[b, s, hk] for s in sel]) * D ** -0.5
        expect = (torch.softmax(logits, 0).unsqueeze(1) * torch.stack([v[b, s, hk] for s in sel])).sum(0)
        torch.testing.assert_close(got[b, t, h], expect, atol=1e-12, rtol=1e-12)


def test_sparse_attention_fp32_path():
    B, T, S, H, D = 1, 9, 11, 2, 8
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    idx = random_indices(B, T, S, 4, causal=False)
    got = ops.sparse_attention(q, k, v, idx, 0.3)
    assert got.dtype == torch.float32
    ref = ops.sparse_attention(q.double(), k.double(), v.double(), idx, 0.3)
    # fp32 softmax over <= 4 keys and dot products of length 8: errors of a few ulps.
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_minus_one_is_never_read():
    B, T, S, H, D = 1, 3, 6, 2, 4
    q = torch.randn(B, T, H, D)
    k, v = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    k[:, 0], v[:, 0] = float("nan"), float("nan")  # garbage in row 0, as in a reused block
    idx = torch.tensor([[[3, -1, -1], [4, 2, -1], [-1, -1, -1]]], dtype=torch.int32)
    got = ops.sparse_attention(q, k, v, idx, 0.5)
    assert torch.isfinite(got).all()
    assert torch.equal(got[0, 2], torch.zeros(H, D)), "a row with nothing selected gives zeros"
    torch.testing.assert_close(got[0, 0], v[0, 3].float())
    rows = ops.gather_rows(k.view(B, S, -1), torch.tensor([[-1, 2]]))
    assert torch.equal(rows[0, 0], torch.zeros(H * D)) and torch.equal(rows[0, 1], k[0, 2].reshape(-1))


def test_sparse_attention_rejects_bad_indices_and_backends():
    q, k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="position 3"):
        ops.sparse_attention(q, k, v, torch.tensor([[[3], [0]]]), 1.0)
    with pytest.raises(ValueError, match="-2"):
        ops.sparse_attention(q, k, v, torch.tensor([[[-2], [0]]]), 1.0)
    with pytest.raises(ValueError, match="heads"):
        ops.sparse_attention(q, torch.randn(1, 3, 3, 4), torch.randn(1, 3, 3, 4), torch.tensor([[[0], [0]]]), 1.0)
    with pytest.raises(ValueError, match="backend"):
        ops.sparse_attention(q, k, v, torch.tensor([[[0], [0]]]), 1.0, backend="cuda")
    with pytest.raises(ValueError, match="no Triton kernel"):  # the dense sparse_attention has none
        ops.sparse_attention(q, k, v, torch.tensor([[[0], [0]]]), 1.0, backend="triton")


# ------------------------------------------------------------------ deployment numerics
def sylvester(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_is_the_normalised_sylvester_matrix():
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(hadamard(x).double(), x @ sylvester(16) / 4, atol=1e-6, rtol=1e-6)
    q, k = torch.randn(7, 32), torch.randn(9, 32)
    # orthonormal: rotating BOTH sides keeps every dot product
    torch.testing.assert_close(hadamard(q) @ hadamard(k).T, q @ k.T, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(torch.randn(2, 12))


def test_fp8_pow2_quantisation():
    x = torch.randn(64, 32) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x[5] = 0.0
    values, scale = quantize_fp8_pow2(x)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    log = torch.log2(scale)
    assert torch.equal(log, torch.round(log)), "scales are powers of two"
    amax = x.abs().amax(1, keepdim=True)
    nz = amax[:, 0] > 0
    assert (amax[nz] / scale[nz] <= FP8_E4M3_MAX).all() and (amax[nz] / scale[nz] > FP8_E4M3_MAX / 2).all()
    err = (dequantize_fp8(values, scale) - x).abs()
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 for normals; below the normal range
    # the absolute step is 2^-9 * scale.
    assert (err <= torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10)).all()
    assert torch.equal(dequantize_fp8(values, scale)[5], torch.zeros(32))
