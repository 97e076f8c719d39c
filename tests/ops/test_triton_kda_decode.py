"""The fused KDA decode step against its reference, and the reference against the unfused path."""

import pytest
import torch
from conftest import kernel_device

from minidsa import ops
from minidsa.ops.kda_step.reference import kda_decode_ref

pytest.importorskip("triton")
from minidsa.ops.kda_step.decode_triton import kda_decode  # noqa: E402


def _inputs(B=3, H=2, K=12, R=20, W=4, S=5, seed=0, dtype=torch.float32, weight_dtype=None):
    """(projected, f_a, b, conv_weight, w_fb, A_log, dt_bias, conv_pool, state_pool, slots)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    wd = weight_dtype or dtype
    C = 3 * H * K
    slots = torch.tensor([4, 0, 2][:B])  # out of order, not 0..B-1
    return (r(B, C).to(wd), r(B, R).to(wd), r(B, H).to(wd), (r(C, 1, W) * 0.5).to(wd), (r(H * K, R) * 0.3).to(wd),
            r(H + 2) * 0.5, r(H * K) * 0.5, r(S, W - 1, C), r(S, H, K, K) * 0.3, slots)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_reference(weight_dtype):
    dev = kernel_device()
    # K = 12: padded key rows and value columns; R = 20: a partial decay-rank tile; bf16 projections and
    # weights as a bf16 model passes them (the decay rows are rounded to bf16 in both)
    args = _inputs(K=12, R=20, weight_dtype=weight_dtype)
    want = kda_decode_ref(*args[:7], -5.0, *args[7:])
    before = [t.clone() for t in args[7:9]]
    got = kda_decode(*(t.to(dev) for t in args[:7]), -5.0, *(t.to(dev) for t in args[7:]))
    # one fp32 step: W-tap, R-term and K-term sums and exp/sigmoid to their last bits. A bf16 decay row can
    # round the other way when the two fp32 sums differ in the last bit (one bf16 ulp of z moves g by
    # about 2^-8 of its slope), hence the looser bound there.
    tol = dict(rtol=1e-5, atol=1e-6) if weight_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for name, g_, w_ in zip(("o", "recurrent", "conv"), got, want):
        assert g_.dtype == torch.float32, name
        torch.testing.assert_close(g_.cpu(), w_, **tol, msg=name)
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=0, atol=0)  # the conv state is copied, not computed
    assert all(torch.equal(a, b) for a, b in zip(args[7:9], before))  # the pools are only read


def test_reference_equals_the_unfused_step_fp64():
    projected, f_a, b, cw, w_fb, A_log, dt, conv_pool, pool, slots = _inputs(dtype=torch.float64)
    o, s, c = kda_decode_ref(projected, f_a, b, cw, w_fb, A_log, dt, -5.0, conv_pool, pool, slots)
    # the unfused path, written out: the conv over [stored inputs; x], SiLU, the decay's product
    full = torch.cat([conv_pool[slots], projected.unsqueeze(1)], 1)  # [B, W, C]
    y = (full * cw[:, 0, :].T.unsqueeze(0)).sum(1)
    qkv = torch.nn.functional.silu(y).view(-1, 3, 2, 12)
    assert torch.equal(c, full[:, 1:])
    q, k, v, g, beta = ops.kda_step_inputs(qkv, f_a @ w_fb.T, b, A_log, dt, -5.0)
    # independent of the helper: q is unit length, g in (-5, 0)
    assert torch.allclose(q.norm(dim=-1), torch.ones((), dtype=q.dtype), atol=1e-6) and bool(((g < 0) & (g > -5)).all())
    o2, s2 = ops.kda_recurrent(*(x.unsqueeze(1) for x in (q, k, v, g, beta)), None, pool[slots], backend="torch")
    torch.testing.assert_close(o, o2.squeeze(1), rtol=1e-12, atol=1e-12)  # fp64: only the sum orders differ
    torch.testing.assert_close(s, s2, rtol=1e-12, atol=1e-12)


def test_bad_shapes_are_named():
    projected, f_a, b, cw, w_fb, A_log, dt, conv_pool, pool, slots = _inputs()
    with pytest.raises(ValueError, match="projected"):
        ops.kda_decode(projected[:, :-1], f_a, b, cw, w_fb, A_log, dt, -5.0, conv_pool, pool, slots)
    with pytest.raises(ValueError, match="slots"):
        ops.kda_decode(projected, f_a, b, cw, w_fb, A_log, dt, -5.0, conv_pool, pool, slots[:2])
    with pytest.raises(ValueError, match="w_fb"):
        ops.kda_decode(projected, f_a, b, cw, w_fb[:, :-1], A_log, dt, -5.0, conv_pool, pool, slots)
    with pytest.raises(ValueError, match="conv_pool"):
        ops.kda_decode(projected, f_a, b, cw, w_fb, A_log, dt, -5.0, conv_pool[:, 1:], pool, slots)
