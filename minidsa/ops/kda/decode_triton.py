"""Triton kernel of ``kda_decode``: the contract of ``kda_decode_ref`` in ``minidsa/ops/kda/reference.py``.

The recurrent kernel's decode step (``recurrent_triton.py``) with its inputs built in registers: a program
(batch row, head, BLOCK_V state columns) loads its head's q, k rows and L2-normalises them, computes g from
z, dt_bias and A_log and beta from b, reads its state slice from the sequence's slot of the cache's state
pool, and runs the step. The new state goes to a fresh tensor (the cache is written only when the whole
forward succeeds). One launch: a compiled step would otherwise materialise q, k, v, g, beta and the
gathered state as separate tensors for the recurrence, one kernel each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .recurrent_triton import _recurrent_block_v
from .reference import L2_EPS, check_decode, kda_decode_ref


@triton.jit
def _decode_kernel(qkv_ptr, z_ptr, b_ptr, alog_ptr, dt_ptr, pool_ptr, slot_ptr, o_ptr, s_ptr,
                   H, K, V, s_qb, s_qt, s_qh, s_zb, s_bb, lower_bound, scale, eps,
                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_K)
    e = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    d_ok, e_ok = d < K, e < V
    row = qkv_ptr + b * s_qb + h * s_qh
    q = tl.load(row + d, mask=d_ok, other=0.0).to(tl.float32)
    k = tl.load(row + s_qt + d, mask=d_ok, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * s_qt + e, mask=e_ok, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))
    zz = tl.load(z_ptr + b * s_zb + h * K + d, mask=d_ok, other=0.0).to(tl.float32) + \
        tl.load(dt_ptr + h * K + d, mask=d_ok, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    g = tl.where(d_ok, lower_bound / (1.0 + tl.exp(-a * zz)), 0.0)  # padded rows: g = 0 keeps them at 0
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + b * s_bb + h).to(tl.float32)))
    slot = tl.load(slot_ptr + b).to(tl.int64)
    mask = d_ok[:, None] & e_ok[None, :]
    offs = h * K * V + d[:, None] * V + e[None, :]
    S = tl.load(pool_ptr + slot * H * K * V + offs, mask=mask, other=0.0).to(tl.float32)
    S = S * tl.exp(g)[:, None]
    pred = tl.sum(S * k[:, None], axis=0)
    S = S + (beta * k)[:, None] * (v - pred)[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(o_ptr + bh * V + e, o.to(o_ptr.dtype.element_ty), mask=e_ok)
    tl.store(s_ptr + b * H * K * V + offs, S, mask=mask)


def kda_decode(qkv, z, b, A_log, dt_bias, lower_bound, state_pool, slots, scale=None):
    """One fused decode step: (o [B, H, K] in qkv's dtype, new states [B, H, K, K] fp32); see kda_decode_ref."""
    B, H, K, V = check_decode(qkv, z, b, A_log, dt_bias, state_pool, slots)
    if torch.float64 in (qkv.dtype, z.dtype, state_pool.dtype):  # exactness tests only
        return kda_decode_ref(qkv, z, b, A_log, dt_bias, lower_bound, state_pool, slots, scale)
    o = torch.empty(B, H, V, dtype=qkv.dtype, device=qkv.device)
    state = torch.empty(B, H, K, V, dtype=torch.float32, device=qkv.device)
    if B == 0:
        return o, state
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    z, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (z, b))
    scale = K ** -0.5 if scale is None else float(scale)
    bv = _recurrent_block_v(K, V, qkv.device.type == "cuda")
    _decode_kernel[(B * H, triton.cdiv(V, bv))](
        qkv, z, b, A_log, dt_bias.contiguous(), state_pool.contiguous(), slots.contiguous(), o, state,
        H, K, V, qkv.stride(0), qkv.stride(1), qkv.stride(2), z.stride(0), b.stride(0),
        float(lower_bound), scale, L2_EPS, BLOCK_K=triton.next_power_of_2(K), BLOCK_V=bv, num_warps=4)
    return o, state
