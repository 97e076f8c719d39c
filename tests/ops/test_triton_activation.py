"""SiTU-GLU forward and backward kernels (minidsa/ops/activation/situ_glu_triton.py) against their references, on odd
shapes, under TRITON_INTERPRET=1 on the CPU (or compiled on a GPU)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minidsa.ops.activation import reference as ref  # noqa: E402
from minidsa.ops.activation import situ_glu_triton as kern  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def close(got, want):
    """tanh is built from exp in the kernels (~1e-7 relative to torch.tanh). In 1 - tanh^2 near saturation
    that becomes an absolute error of a few 1e-7 against terms of order 1 (both sides round 1 - t*t in
    fp32), so the bound is relative to the output's scale, not to each element."""
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6 * max(1.0, float(want.abs().max())))


def inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # wide enough to saturate both tanh clips (beta 4 and 25) and the sigmoid
    return [(torch.randn(shape, generator=g) * s).to(DEV) for s in (12.0, 40.0, 1.0)]


@pytest.mark.parametrize("shape", [(7, 61), (3, 1, 130)])
def test_forward_and_backward_match_the_references(shape):
    g, u, grad = inputs(shape)
    close(kern.situ_glu(g, u, 4.0, 25.0), ref.situ_glu_ref(g, u, 4.0, 25.0))
    for got, want in zip(kern.situ_glu_backward(g, u, grad, 4.0, 25.0),
                         ref.situ_glu_backward_ref(g, u, grad, 4.0, 25.0)):
        close(got, want)


def test_non_contiguous_and_empty_inputs():
    g, u, grad = inputs((9, 40))
    gt, ut, gradt = g.t(), u.t(), grad.t()  # transposed views
    close(kern.situ_glu(gt, ut, 4.0, 25.0), ref.situ_glu_ref(gt, ut, 4.0, 25.0))
    dg, du = kern.situ_glu_backward(gt, ut, gradt, 4.0, 25.0)
    close(dg, ref.situ_glu_backward_ref(gt, ut, gradt, 4.0, 25.0)[0])
    assert kern.situ_glu(g[:0], u[:0], 4.0, 25.0).shape == (0, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_of_one_fused_output_are_read_in_place(dtype, monkeypatch):
    """gate and up as the two halves of one [B, T, 2F] projection (odd F, bf16 as a model gives them): read
    through their row strides, with no copy made (``Tensor.contiguous`` not called), equal to the reference
    on the same slices."""
    fused = inputs((2, 5, 2 * 61))[0].to(dtype)
    g, u = fused[..., :61], fused[..., 61:] / 3
    want = ref.situ_glu_ref(g, u, 4.0, 25.0)
    copies = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **k: copies.append(t.shape) or real(t, *a, **k))
    got = kern.situ_glu(g, u, 4.0, 25.0)
    monkeypatch.undo()
    assert copies == [] and got.shape == (2, 5, 61) and got.is_contiguous()
    close(got, want)


def test_a_bf16_result_is_the_fp32_one_rounded_to_nearest_even():
    """``dtype``: the same fp32 values rounded once as torch rounds them (the interpreter's own cast would
    truncate), and the reference's contract within that one rounding."""
    g, u, _ = inputs((7, 61))
    got = kern.situ_glu(g, u, 4.0, 25.0, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, kern.situ_glu(g, u, 4.0, 25.0).to(torch.bfloat16))
    want = ref.situ_glu_ref(g, u, 4.0, 25.0, torch.bfloat16).float()
    assert bool(((got.float() - want).abs() <= want.abs().clamp_min(1e-30) * 2.0 ** -7).all())


def test_shape_mismatch_is_rejected_like_the_reference():
    g, u, _ = inputs((4, 5))
    for fn in (ref.situ_glu_ref, kern.situ_glu):
        with pytest.raises(ValueError, match="u has shape"):
            fn(g, u[:, :3], 4.0, 25.0)
