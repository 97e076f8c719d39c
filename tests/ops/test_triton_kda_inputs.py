"""KDA's per-token inputs kernel (minidsa/ops/kda_step/inputs_triton.py) against its reference, on odd shapes, under
TRITON_INTERPRET=1 on the CPU (or compiled on a GPU)."""

import pytest
import torch
from conftest import kernel_device

from minidsa import ops
from minidsa.ops.kda_step.reference import kda_inputs_ref, kda_step_inputs

pytest.importorskip("triton")
from minidsa.ops.kda_step.inputs_triton import kda_inputs  # noqa: E402


def inputs(lead, H, K, seed=0):
    """qkv [*lead, 3, H, K]; z and b as slices of wider bf16 products (row strides, as the layer has them)."""
    g = torch.Generator().manual_seed(seed)
    dev = kernel_device()
    qkv = torch.randn(*lead, 3, H, K, generator=g).to(dev)
    wide = (torch.randn(*lead, 2 * H * K + H, generator=g) * 2).to(dev, torch.bfloat16)
    A_log, dt = torch.randn(H + 2, generator=g).to(dev), torch.randn(H * K, generator=g).to(dev)
    return qkv, wide[..., H * K: 2 * H * K], wide[..., 2 * H * K:], A_log, dt


@pytest.mark.parametrize("lead,H,K", [((63,), 3, 60), ((2, 5), 4, 33), ((1, 1), 16, 8)])
def test_kda_inputs_match_the_reference(lead, H, K):
    """fp32 rounding apart (exp's and sqrt's last bits, the order of a K-term sum), on values of order 1."""
    args = inputs(lead, H, K)
    got, want = kda_inputs(*args, -5.0), kda_inputs_ref(*args, -5.0)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=4e-6, atol=2e-6)
    # the op is kda_step_inputs without v
    q, k, v, g, beta = kda_step_inputs(*args, -5.0)
    assert all(torch.equal(a, b) for a, b in zip((q, k, g, beta), want)) and torch.equal(v, args[0][..., 2, :, :])


def test_kda_step_inputs_through_the_dispatch_keeps_v_a_view():
    args = inputs((7,), 2, 16)
    for backend in ("torch", "triton"):
        q, k, v, g, beta = ops.kda_step_inputs(*args, -5.0, backend=backend)
        assert v.data_ptr() == args[0][..., 2, :, :].data_ptr() and g.shape == (7, 2, 16) and beta.shape == (7, 2)


def test_kda_inputs_fp64_empty_and_bad_input():
    qkv, z, b, A_log, dt = inputs((4,), 2, 16)
    args64 = [t.double() for t in (qkv, z, b, A_log, dt)]
    assert all(torch.equal(x, y) for x, y in zip(kda_inputs(*args64, -5.0), kda_inputs_ref(*args64, -5.0)))
    assert kda_inputs(qkv[:0], z[:0], b[:0], A_log, dt, -5.0)[3].shape == (0, 2)
    with pytest.raises(ValueError, match="z has shape"):
        kda_inputs(qkv, z[..., :31], b, A_log, dt, -5.0)
    with pytest.raises(ValueError, match="qkv must be"):
        kda_inputs(qkv[:, :2], z, b, A_log, dt, -5.0)
