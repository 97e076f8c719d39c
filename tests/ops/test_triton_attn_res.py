"""The Attention-Residual mixer kernel (minidsa/ops/attn_res/mix_triton.py) against its reference, on odd shapes,
under TRITON_INTERPRET=1 on the CPU (or compiled on a GPU)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minidsa import ops  # noqa: E402
from minidsa.ops.attn_res import mix_triton as kern  # noqa: E402
from minidsa.ops.attn_res.reference import attn_res_mix_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(n, lead, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # sources of different scales, so that the scores spread and the softmax is far from uniform
    scale = torch.tensor([0.1, 3.0, 1.0, 30.0, 0.5])[:n].view(n, *[1] * (len(lead) + 1))
    sources = (torch.randn(n, *lead, d, generator=g) * scale).to(DEV, dtype)
    query = torch.randn(d, generator=g).to(DEV) * 0.5
    gamma = (1 + 0.3 * torch.randn(d, generator=g)).to(DEV)
    return sources, query, gamma


# fp32 in both; the kernel scores v . (gamma * w) / rms(v) instead of normalising v first, and sums by online
# softmax: a few ulps of the output's scale.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,lead,d", [(1, (5,), 60), (3, (2, 7), 60), (5, (63,), 33), (4, (1, 1), 130)])
def test_mixer_matches_the_reference(n, lead, d):
    sources, query, gamma = inputs(n, lead, d)
    out, alpha = kern.attn_res_mix(sources, query, gamma, 1e-5, True)
    want, want_alpha = attn_res_mix_ref(sources, query, gamma, 1e-5, True)
    assert out.shape == want.shape and alpha.shape == want_alpha.shape == (n, *lead)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(alpha, want_alpha, **TOL)
    torch.testing.assert_close(kern.attn_res_mix(sources, query, gamma), want, **TOL)


def test_bf16_sources_and_a_non_contiguous_view():
    sources, query, gamma = inputs(3, (9,), 40, dtype=torch.bfloat16)
    torch.testing.assert_close(kern.attn_res_mix(sources, query, gamma), attn_res_mix_ref(sources, query, gamma),
                               **TOL)
    view = inputs(3, (40,), 9)[0].transpose(1, 2)  # [3, 9, 40], strided
    torch.testing.assert_close(kern.attn_res_mix(view, query, gamma), attn_res_mix_ref(view, query, gamma), **TOL)


def test_public_op_keeps_both_result_types():
    sources, query, gamma = inputs(2, (3,), 16)
    out, pair = ops.attn_res_mix(sources, query, gamma), ops.attn_res_mix(sources, query, gamma, return_weights=True)
    assert isinstance(out, torch.Tensor) and isinstance(pair, tuple) and len(pair) == 2
    torch.testing.assert_close(out, attn_res_mix_ref(sources, query, gamma), **TOL)  # the kernel, on a GPU
    torch.testing.assert_close(pair[0], out, rtol=0, atol=0)


def test_bad_input_is_rejected_like_the_reference():
    sources, query, gamma = inputs(2, (3,), 16)
    for bad in ((sources, query[:15], gamma), (sources[:0], query, gamma), (sources[0, 0], query, gamma)):
        with pytest.raises(ValueError):
            attn_res_mix_ref(*bad)
        with pytest.raises(ValueError):
            kern.attn_res_mix(*bad)

