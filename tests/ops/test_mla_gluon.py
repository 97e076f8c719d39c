"""The sm_90 Gluon kernel for sparse MLA (minidsa/ops/mla/latent_gluon.py) against the reference.

Gluon has no interpreter, so the kernel runs only on a Hopper GPU (sm_90: H100, H200); there these tests
check it against the reference, against the Triton kernel and run to run. On any other machine only the
dispatch tests run: such calls must stay on the Triton kernel, and backend "gluon" must say why it cannot run.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

pytest.importorskip("triton")

from test_triton_mla import paged_case  # noqa: E402

from minidsa import ops  # noqa: E402
from minidsa.ops import _dispatch  # noqa: E402
from minidsa.ops.mla import latent_gluon as lg  # noqa: E402
from minidsa.ops.mla import latent_triton as mt  # noqa: E402
from minidsa.ops.mla import sm90_gluon  # noqa: E402
from minidsa.ops.mla.reference import sparse_mla_decode_ref, sparse_mla_prefill_ref  # noqa: E402

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not SM90, reason="the Gluon kernel is compiled for sm_90 only")


def test_calls_off_sm90_take_the_triton_kernel():
    kv = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    pe = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    assert lg.gluon_fits(kv, pe, 96) is False  # CPU tensors
    if torch.cuda.is_available():
        kv, pe = kv.cuda(), pe.cuda()
        assert lg.gluon_fits(kv.float(), pe.float(), 96) is False  # fp32 planes
        assert lg.gluon_fits(kv, pe, 16) is False  # the Triton kernel's 16-row tiles are faster
        assert lg.gluon_fits(kv, pe, 17) is SM90  # from 17 heads, padded 64-row tiles win
        assert lg.gluon_fits(kv[..., :500], pe, 96) is False  # r not a power of two


def test_the_sm90_forms_are_registered_and_picked_only_where_they_run():
    assert set(ops.GLUON_KERNELS) == {"sparse_mla_decode", "sparse_mla_prefill"}
    for op in ops.GLUON_KERNELS:
        fn = getattr(sm90_gluon, op)  # the reference's signature, like every kernel
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(ops.REFERENCES[op]).parameters)
    x = torch.zeros(1)
    ref = ops.REFERENCES["sparse_mla_decode"]
    assert _dispatch.pick("sparse_mla_decode", "auto", ref, x) is ref  # CPU tensors: the reference
    with pytest.raises(ValueError, match="capability-9.0 GPU.*backend='triton'"):
        _dispatch.pick("sparse_mla_decode", "gluon", ref, x)
    with pytest.raises(ValueError, match="no sm_90 \\(Gluon\\) form"):
        _dispatch.pick("rms_norm", "gluon", ops.REFERENCES["rms_norm"], x)
    with ops.use_backend("gluon"):  # model-wide: the Triton kernels where no sm_90 form runs
        assert _dispatch.pick("sparse_mla_decode", None, ref, x).__module__ == "minidsa.ops.mla.latent_triton"
    if SM90:
        x = x.cuda()
        assert _dispatch.pick("sparse_mla_decode", "auto", ref, x) is sm90_gluon.sparse_mla_decode
        assert _dispatch.pick("sparse_mla_decode", "triton", ref, x) is mt.sparse_mla_decode


@sm90
@pytest.mark.parametrize("H, T, K, splits, q_dtype, dtype, r, dr", [
    (96, 1, 300, None, torch.bfloat16, torch.bfloat16, 512, 64),
    (40, 2, 130, 1, torch.bfloat16, torch.bfloat16, 512, 64),
    (17, 2, 130, None, torch.bfloat16, torch.bfloat16, 512, 64),  # 47 of the 64 rows padding
    (64, 1, 1000, 3, torch.float32, torch.bfloat16, 512, 64),
    (48, 1, 20, 3, torch.float16, torch.float16, 512, 64),
    (64, 1, 333, 2, torch.bfloat16, torch.bfloat16, 256, 32)])
def test_decode_matches_reference_and_triton_kernel(H, T, K, splits, q_dtype, dtype, r, dr):
    """16-bit planes at the real widths (and r=256, dr=32), NaN in every unselected row, -1 padding, a query
    with nothing selected, T not 1, a split count that does not divide K, splits with no position at all
    (K=20: splits 2 and 3 are empty) and splits of an odd number of 64-position tiles (the two compute
    groups take the tiles in turn; K=333 in 2 splits: 3 tiles each). Tolerance as for the Triton kernel
    (test_triton_mla.test_bf16_decode_and_prefill_on_gpu): q and p are rounded to bf16 for the tensor
    cores where the reference computes in fp32; outputs are convex combinations of O(1) rows, so 2e-2."""
    B, bs = 3, 64
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[1000, 700, 301], dtype=dtype,
                                    device="cuda", seed=H + K)
    q_lat = torch.randn(B, T, H, r, device="cuda").to(q_dtype)
    q_pe = torch.randn(B, T, H, dr, device="cuda").to(q_dtype)
    assert lg.gluon_fits(kv, pe, H)
    scale = 192 ** -0.5

    def run(gluon=lg):
        out = torch.full((B, T, H, r), float("nan"), device="cuda")
        mt._latent_attention(q_lat, q_pe, kv, pe, table, idx, scale, out, out.stride()[:3], num_splits=splits,
                             gluon=gluon)
        return out

    out = run()
    ref = sparse_mla_decode_ref(q_lat, q_pe, kv, pe, table, idx, scale)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[0, -1], torch.zeros_like(out[0, -1]))  # nothing selected: zeros
    assert torch.equal(out, run())  # fixed splits, no atomics: bitwise run to run
    # The same bf16 roundings of q and p; only the summation order differs (fp32 accumulators), and a
    # score that rounds p the other way moves an output by at most 2^-8 of a row value.
    torch.testing.assert_close(out, run(gluon=None), atol=1e-2, rtol=1e-2)
    if splits is None:  # the op's sm_90 form is this path
        assert torch.equal(out, ops.sparse_mla_decode(q_lat, q_pe, kv, pe, table, idx, scale, backend="gluon"))


@sm90
def test_prefill_with_many_heads_matches_reference():
    """Prefill with more than 32 heads takes the Gluon kernel too (one split, o_latent written in bf16)."""
    B, T, H, r, dr, dn, dv, K, bs = 2, 70, 48, 512, 64, 128, 128, 200, 64
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[700, 301], dtype=torch.bfloat16,
                                    device="cuda", seed=11)
    q = torch.randn(B, T, H, dn + dr, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(H * (dn + dv), r, device="cuda") / math.sqrt(r)).bfloat16()
    assert lg.gluon_fits(kv, pe, H)
    out = mt.sparse_mla_prefill_absorbed(q, kv, pe, table, idx, w, (dn + dr) ** -0.5, gluon=lg)
    ref = sparse_mla_prefill_ref(q, kv, pe, table, idx, w, (dn + dr) ** -0.5)
    # As test_bf16_decode_and_prefill_on_gpu: q_latent and o_latent are rounded to bf16 too: 3 %.
    torch.testing.assert_close(out, ref, atol=3e-2 * float(ref.abs().max()), rtol=3e-2)
