"""The RMSNorm kernel (minidsa/ops/norm/rms_triton.py) against its reference, on odd shapes, under
TRITON_INTERPRET=1 on the CPU (or compiled on a GPU)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minidsa import ops  # noqa: E402
from minidsa.ops.norm import rms_triton as kern  # noqa: E402
from minidsa.ops.norm.reference import rms_norm_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(lead, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, d, generator=g) * torch.logspace(-2, 2, d)).to(DEV, dtype)  # channels of many scales
    return x, (1 + 0.3 * torch.randn(d, generator=g)).to(DEV)


@pytest.mark.parametrize("lead,d", [((63,), 60), ((2, 7), 33), ((1,), 130), ((3, 1), 8)])
def test_rms_norm_matches_the_reference_in_fp32(lead, d):
    x, w = inputs(lead, d, torch.float32)
    y = kern.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.float32 and y.shape == x.shape
    # the mean of squares summed in another order: fp32 rounding of the output's scale
    torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-5), rtol=2e-6, atol=1e-6)


def test_rms_norm_bf16_in_bf16_out_within_one_rounding():
    x, w = inputs((63,), 60, torch.bfloat16)
    y, want = kern.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    # both round an fp32 value to bf16 once; the fp32 values differ by fp32 rounding, so at most one bf16 ulp
    ulp = want.float().abs().clamp_min(1e-30) * 2.0 ** -7
    assert bool(((y.float() - want.float()).abs() <= ulp).all())


@pytest.mark.parametrize("lead,d", [((63,), 60), ((2, 7), 33)])
def test_rms_norm_of_an_fp32_residual_cast_on_the_way(lead, d):
    """``dtype``: the norm of x cast to bf16, in bf16, in one pass: bit for bit the kernel on the cast input
    (the same rounding of x, then the same arithmetic), and the reference's contract."""
    x, w = inputs(lead, d, torch.float32)
    x[..., :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0])  # ties: to the even neighbour
    y = kern.rms_norm(x, w, 1e-5, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, kern.rms_norm(x.to(torch.bfloat16), w, 1e-5))
    assert torch.equal(rms_norm_ref(x, w, 1e-5, torch.bfloat16), rms_norm_ref(x.to(torch.bfloat16), w, 1e-5))
    assert ops.rms_norm(x, w, 1e-5, torch.bfloat16, backend="torch").dtype == torch.bfloat16


def test_rms_norm_of_a_strided_view_and_empty_rows():
    x, w = inputs((9,), 80, torch.float32)
    view = x[:, :60]  # the latent part of a wider projection, as MLA's kv_a_layernorm reads it
    torch.testing.assert_close(kern.rms_norm(view, w[:60], 1e-6), rms_norm_ref(view, w[:60], 1e-6),
                               rtol=2e-6, atol=1e-6)
    assert kern.rms_norm(x[:0], w, 1e-5).shape == (0, 80)


def test_rms_norm_fp64_and_bad_input():
    x = torch.randn(4, 16, dtype=torch.float64, device=DEV)
    w = torch.ones(16, dtype=torch.float64, device=DEV)
    assert torch.equal(kern.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    with pytest.raises(ValueError, match="weight has shape"):
        ops.rms_norm(x, torch.ones(15, dtype=torch.float64, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, w, 0.0)
    with pytest.raises(TypeError, match="x must be"):
        ops.rms_norm(x.long(), w, 1e-5)
