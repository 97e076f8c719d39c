"""The attention layers' output gate kernel (minidsa/ops/gate/gate_triton.py) against its reference, on odd
shapes, under TRITON_INTERPRET=1 on the CPU (or compiled on a GPU)."""

import pytest
import torch
from conftest import kernel_device

from minidsa import ops
from minidsa.ops.gate.reference import output_gate_ref

pytest.importorskip("triton")
from minidsa.ops.gate import gate_triton as kern  # noqa: E402


def inputs(lead, H, K, seed=0):
    """o [*lead, H, K] fp32 of many scales, gate as the middle slice of a wider bf16 projection, weight [K]."""
    g = torch.Generator().manual_seed(seed)
    dev = kernel_device()
    o = (torch.randn(*lead, H, K, generator=g) * torch.logspace(-2, 2, K)).to(dev)
    fused = (torch.randn(*lead, 3 * H * K, generator=g) * 4).to(dev, torch.bfloat16)
    return o, fused[..., H * K: 2 * H * K], (1 + 0.3 * torch.randn(K, generator=g)).to(dev)


@pytest.mark.parametrize("lead,H,K", [((63,), 3, 60), ((2, 5), 4, 33), ((1, 1), 16, 8)])
@pytest.mark.parametrize("norm", [True, False])
def test_output_gate_matches_the_reference(lead, H, K, norm):
    """fp32 out: the same expression up to exp's last bits and the norm's summation order (fp32 rounding of
    the output's scale). bf16 out: both round an fp32 value to bf16 once, so at most one bf16 ulp apart."""
    o, gate, w = inputs(lead, H, K)
    w = w if norm else None
    got, want = kern.output_gate(o, gate, w, 1e-5, torch.float32), output_gate_ref(o, gate, w, 1e-5, torch.float32)
    assert got.shape == (*lead, H * K) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6 * float(want.abs().max()))
    got = kern.output_gate(o, gate, w, 1e-5, torch.bfloat16).float()
    want = output_gate_ref(o, gate, w, 1e-5, torch.bfloat16).float()
    assert bool(((got - want).abs() <= want.abs().clamp_min(1e-30) * 2.0 ** -7).all())


def test_output_gate_fp64_empty_and_bad_input():
    o, gate, w = inputs((4,), 2, 16)
    o64, g64, w64 = o.double(), gate.double(), w.double()
    assert torch.equal(kern.output_gate(o64, g64, w64, 1e-5, torch.float64),
                       output_gate_ref(o64, g64, w64, 1e-5, torch.float64))
    assert kern.output_gate(o[:0], gate[:0], w, 1e-5, torch.bfloat16).shape == (0, 32)
    with pytest.raises(ValueError, match="gate has shape"):
        ops.output_gate(o, gate[..., :31], w, 1e-5, torch.float32)
    with pytest.raises(ValueError, match="o must be"):
        ops.output_gate(o[0, 0], gate[0, :16], None, 1e-5, torch.float32)
