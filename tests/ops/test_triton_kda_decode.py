"""The fused KDA decode step against its reference, and the reference against the unfused path."""

import pytest
import torch
from conftest import kernel_device

from minidsa import ops
from minidsa.ops.kda.reference import kda_decode_ref

pytest.importorskip("triton")
from minidsa.ops.kda.decode_triton import kda_decode  # noqa: E402


def _inputs(B=3, H=2, K=12, S=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    qkv = torch.nn.functional.silu(r(B, 3, H, K))
    slots = torch.tensor([4, 0, 2][:B])  # out of order, not 0..B-1
    return qkv, r(B, H * K), r(B, H), r(H + 2) * 0.5, r(H * K) * 0.5, r(S, H, K, K) * 0.3, slots


def test_decode_kernel_matches_reference():
    dev = kernel_device()
    args = _inputs(K=12)  # K = 12: padded key rows and value columns
    qkv, z, b, A_log, dt, pool, slots = args
    want_o, want_s = kda_decode_ref(qkv, z, b, A_log, dt, -5.0, pool, slots)
    before = pool.clone()
    got_o, got_s = kda_decode(*(t.to(dev) for t in (qkv, z, b, A_log, dt)), -5.0, pool.to(dev), slots.to(dev))
    # one fp32 step: a K-term sum and exp/sigmoid to their last bits
    torch.testing.assert_close(got_o.cpu(), want_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=1e-5, atol=1e-6)
    assert torch.equal(pool, before)  # the pool is only read


def test_reference_equals_the_unfused_step_fp64():
    qkv, z, b, A_log, dt, pool, slots = _inputs(dtype=torch.float64)
    o, s = kda_decode_ref(qkv, z, b, A_log, dt, -5.0, pool, slots)
    q, k, v, g, beta = ops.kda_step_inputs(qkv, z, b, A_log, dt, -5.0)
    # independent of the helper: q is unit length, g in (-5, 0)
    assert torch.allclose(q.norm(dim=-1), torch.ones((), dtype=q.dtype), atol=1e-6) and bool(((g < 0) & (g > -5)).all())
    o2, s2 = ops.kda_recurrent(*(x.unsqueeze(1) for x in (q, k, v, g, beta)), None, pool[slots], backend="torch")
    assert torch.equal(o, o2.squeeze(1)) and torch.equal(s, s2)


def test_bad_shapes_are_named():
    qkv, z, b, A_log, dt, pool, slots = _inputs()
    with pytest.raises(ValueError, match="dim 1 must be 3"):
        ops.kda_decode(qkv[:, :2], z, b, A_log, dt, -5.0, pool, slots)
    with pytest.raises(ValueError, match="slots"):
        ops.kda_decode(qkv, z, b, A_log, dt, -5.0, pool, slots[:2])
