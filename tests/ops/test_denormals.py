"""The KDA ops flush subnormal floats on the CPU (ops/_denormals.py): the thread's mode is restored after,
a mode the caller set is left alone, and the results are the unflushed reference's."""

import torch

import minidsa
from minidsa.ops._denormals import _flushing, flush_denormals
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
    o_ref, s_ref = kda_chunk_ref(q, k, v, g, beta, None, state, 64)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
