"""The sm_90 Gluon kernel of the union-form prefill (minidsa/ops/mla/prefill_gluon.py): on sm_90 against the
reference, the Triton kernel and itself run to run (no interpreter: GPU only, like test_mla_gluon.py);
everywhere, that other calls stay on the Triton kernel."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from test_mla_gluon import SM90, sm90  # noqa: E402  (the decode kernel's tests: the same sm_90 gate)
from test_triton_mla import paged_case  # noqa: E402

from minidsa.ops.mla import prefill_attn_triton as pa  # noqa: E402
from minidsa.ops.mla import prefill_form as pf  # noqa: E402
from minidsa.ops.mla import prefill_gluon as pg  # noqa: E402
from minidsa.ops.mla import prefill_triton as mp  # noqa: E402
from minidsa.ops.mla import sm90_gluon  # noqa: E402
from minidsa.ops.mla.reference import sparse_mla_prefill_ref  # noqa: E402


def test_calls_off_sm90_take_the_triton_kernel():
    q = torch.zeros(1, 5, 16, 192, dtype=torch.bfloat16)
    kv, pe = torch.zeros(1, 8, 16, 256, dtype=torch.bfloat16), torch.zeros(1, 8, 64)
    assert pa.gluon_attends(pg, q, kv, pe.bfloat16(), 128, 0.1, 128) is None  # CPU tensors
    assert pa.gluon_attends(None, q, kv, pe.bfloat16(), 128, 0.1, 128) is None  # the Triton form
    if torch.cuda.is_available():
        q, kv, pe = q.cuda(), kv.cuda(), pe.cuda()
        assert (pa.gluon_attends(pg, q, kv, pe.bfloat16(), 128, 0.1, 128) is pg) is SM90
        assert not pa.gluon_attends(pg, q, kv, pe, 128, 0.1, 128)  # fp32 k_pe
        assert not pa.gluon_attends(pg, q, kv, pe.bfloat16(), 128, 0.1, 64)  # 64-query tiles
        assert not pa.gluon_attends(pg, q, kv, pe.bfloat16(), 128, -0.1, 128)  # max on raw scores needs scale > 0
        assert not pa.gluon_attends(pg, q[..., :128], kv[..., :224], pe.bfloat16()[..., :32], 96, 0.1, 128)  # dv 128


def test_the_gluon_kernel_moves_the_break_even_up():
    """The cost model charges the Gluon kernel less per union pair: the union form pays at larger unions."""
    for heads in (16, 32, 64, 96):
        assert pf.union_break_even(heads, gluon=True) > pf.union_break_even(heads)


def case(B, T, K, shared, dtype, seed, dn=128, dr=64):
    """16 heads, dn = dv; ``shared``: queries 40.. pick mostly the same positions (unions of a few chunks,
    many masked slots), else independent picks (unions of many chunks)."""
    dev, H, r, dv, bs = "cuda", 16, 512, dn, 64
    kv, pe, table, idx = paged_case(B, T, K, r, dr, bs, contexts=[T + 700, T], dtype=dtype, device=dev, seed=seed)
    if shared:  # queries 40.. share 80 % of their picks (distinct within a query, as top-k's are)
        perm = torch.randperm(T, device=dev).int()
        common, rest, n = perm[:K], perm[K:], int(0.8 * K)
        own = rest[torch.rand(B, T - 40, rest.numel(), device=dev).argsort(-1)[..., : K - n]]
        idx[:, 40:] = torch.cat([common[:n].expand(B, T - 40, n), own], -1)
        idx[:, 60:, :3] = -1
        kv, pe = torch.nan_to_num(kv), torch.nan_to_num(pe)  # rows selected by one query reach its whole tile
    q = torch.randn(B, T, H, dn + dr, device=dev).to(dtype)
    w = (torch.randn(H * (dn + dv), r, device=dev) / math.sqrt(r)).to(dtype)
    return q, kv, pe, table, idx, w, (dn + dr) ** -0.5


@sm90
@pytest.mark.parametrize("T, K, shared, dtype, dn, dr", [
    (300, 200, False, torch.bfloat16, 128, 64), (300, 200, True, torch.bfloat16, 128, 64),
    (129, 77, True, torch.float16, 128, 64), (1, 5, False, torch.bfloat16, 128, 64),
    (700, 130, True, torch.bfloat16, 64, 32)])
def test_matches_reference_and_triton_kernel(T, K, shared, dtype, dn, dr, monkeypatch):
    """T not a multiple of the 128-query tile (and T = 1), unions whose count is not a multiple of the 64-slot
    chunk, NaN in unselected rows, -1 padding, a query with nothing selected, the K3 widths and dn = dv = 64,
    dr = 32. Tolerance as for the Triton kernel (test_triton_mla_prefill.test_bf16_at_the_real_widths_on_gpu):
    q and p are rounded to 16 bits for the tensor cores where the reference works in fp32, 3 % of the output
    scale. Against the Triton kernel: the same roundings, sums in another order (chunks of 64 against 32), the
    scale applied in the exponent's FMA instead of to the scores: 1 %."""
    monkeypatch.setattr(pf, "FORM", "union")
    q, kv, pe, table, idx, w, scale = case(2, T, K, shared, dtype, seed=T + K, dn=dn, dr=dr)
    calls = []
    monkeypatch.setattr(pg, "attend", lambda *a, f=pg.attend: calls.append(1) or f(*a))
    out = sm90_gluon.sparse_mla_prefill(q, kv, pe, table, idx, w, scale)
    assert calls, "the Gluon kernel did not run"
    ref = sparse_mla_prefill_ref(q, kv, pe, table, idx, w, scale)
    torch.testing.assert_close(out, ref, atol=3e-2 * float(ref.abs().max()), rtol=3e-2)
    assert torch.equal(out, sm90_gluon.sparse_mla_prefill(q, kv, pe, table, idx, w, scale))  # run to run
    triton_out = mp.sparse_mla_prefill(q, kv, pe, table, idx, w, scale)
    assert len(calls) == 2
    torch.testing.assert_close(out, triton_out, atol=1e-2 * float(ref.abs().max()), rtol=1e-2)
