"""The KDA ops flush subnormal floats on the CPU (ops/_denormals.py): the thread's mode is restored after,
a mode the caller set is left alone, and the results are the unflushed reference's. exp's arguments are
floored at -87, and the masked entries of a softmax are still exact zeros."""

import math

import torch

import minidsa
from minidsa.ops._denormals import EXP_FLOOR, _flushing, floored_exp, flush_denormals
from minidsa.ops.attention.reference import masked_softmax
from minidsa.ops.kda.reference import kda_chunk_ref


def test_the_mode_is_set_within_and_restored_after():
    assert not _flushing()
    with flush_denormals(torch.zeros(1)):
        assert _flushing()
        assert float(torch.tensor([1e-39]) * 1.0) == 0.0  # a subnormal reads as zero
    assert not _flushing()
    with flush_denormals(torch.zeros(1, device="meta")):  # not in CPU memory: nothing changes
        assert not _flushing()


def test_a_mode_the_caller_set_stays():
    torch.set_flush_denormal(True)
    try:
        with flush_denormals(torch.zeros(1)):
            assert _flushing()
        assert _flushing()
    finally:
        torch.set_flush_denormal(False)


def test_kda_chunk_with_long_decays_equals_the_unflushed_reference():
    """Decays near the model's floor make exp(G) subnormal inside a chunk; flushing those to zero must not move
    any output: a subnormal contributes below 1.2e-38, under the last bit of every O(1e-3)+ value here."""
    torch.manual_seed(0)
    B, T, H, K = 2, 128, 2, 16
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1) for _ in range(2))
    v, g = torch.randn(B, T, H, K), -2.7 * torch.rand(B, T, H, K) - 0.1
    beta, state = torch.rand(B, T, H), torch.randn(B, H, K, K)
    o, s = minidsa.ops.kda_chunk(q, k, v, g, beta, None, state, 64, backend="torch")
    assert not _flushing()
    o_ref, s_ref, _ = kda_chunk_ref(q, k, v, g, beta, None, state, 64)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_floored_exp_is_exp_above_the_floor_and_keeps_nan():
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([0.0, -1.0, -86.9, EXP_FLOOR, -87.5, -200.0, -math.inf, math.nan], dtype=dtype)
        y = floored_exp(x)
        assert torch.equal(y[:4], x[:4].exp())
        assert torch.equal(y[4:7], torch.full((3,), EXP_FLOOR, dtype=dtype).exp())  # e^-87, a normal number
        assert y[7].isnan()


def test_masked_softmax_gives_masked_keys_exact_zeros():
    """Scores spread over 300 (exponents far below the floor) and masked keys: the masked ones are exactly 0,
    a row with no valid key is all zeros, and the rest is torch.softmax over the valid keys (fp64: every
    weight floored at e^-87 is below 1e-37, under the 1e-15 compared)."""
    torch.manual_seed(0)
    s = torch.randn(4, 3, 16, dtype=torch.float64) * 100
    valid = torch.rand(4, 1, 16) < 0.6
    valid[0] = False
    p = masked_softmax(s, valid)
    want = torch.softmax(s.masked_fill(~valid, -math.inf), dim=-1).nan_to_num(0.0)
    assert torch.equal(p[~valid.expand_as(p)], torch.zeros_like(p[~valid.expand_as(p)]))
    assert torch.equal(p[0], torch.zeros_like(p[0]))
    torch.testing.assert_close(p, want, rtol=0, atol=1e-15)
    s[1, 0, valid[1, 0].nonzero()[0]] = math.nan  # a NaN score at a valid key still shows
    assert masked_softmax(s, valid)[1, 0].isnan().any()
