"""Triton kernel of ``kda_decode``: the contract of ``kda_decode_ref`` in ``minidsa/ops/kda_step/reference.py``.

The recurrent kernel's decode step (``ops/kda/recurrent_triton.py``) with everything between the layer's two input
products and the recurrence built in registers. A program (batch row, head, BLOCK_V state columns):
- runs the short convs of its head's q and k channels and of its v columns, from the sequence's slot of the
  conv-state pool and this step's projected row, and applies SiLU; the program of the head's first V block
  writes the new conv state of the q and k channels, every program that of its v columns;
- computes its head's K decay pre-activations z = W_fb[head rows] f_a (a [K, R] weight tile; the rows are
  rounded to W_fb's dtype, as the layer's product rounds them), then g, and beta from b;
- L2-normalises q and k, reads its state slice from the recurrent-state pool and runs the step.
The new states go to fresh tensors (the cache is written only when the whole forward succeeds). One launch
where a compiled step ran six: the conv-state gather, the conv, SiLU and their splits, the decay's up
projection, and the recurrence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_decode
from .reference import L2_EPS, kda_decode_ref


@triton.jit
def _conv_silu(x_ptr, pool_ptr, w_ptr, new_ptr, c, ok, write_ok, C, W: tl.constexpr):
    """SiLU of the causal conv of channels ``c`` at this step: taps over the W-1 stored inputs, then x;
    where ``write_ok``, the new conv state (the last W-1 inputs) goes to new_ptr [W-1, C]."""
    y = tl.zeros(c.shape, tl.float32)
    for i in tl.static_range(W - 1):
        st = tl.load(pool_ptr + i * C + c, mask=ok, other=0.0).to(tl.float32)
        y += tl.load(w_ptr + c * W + i, mask=ok, other=0.0).to(tl.float32) * st
        if i > 0:
            tl.store(new_ptr + (i - 1) * C + c, st, mask=write_ok)
    x = tl.load(x_ptr + c, mask=ok, other=0.0).to(tl.float32)
    y += tl.load(w_ptr + c * W + (W - 1), mask=ok, other=0.0).to(tl.float32) * x
    tl.store(new_ptr + (W - 2) * C + c, x, mask=write_ok)
    return y / (1.0 + tl.exp(-y))


# slot_ptr may be a slice of the step's metadata at any offset: its alignment is not specialised on.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _decode_kernel(x_ptr, fa_ptr, b_ptr, cw_ptr, wfb_ptr, alog_ptr, dt_ptr, cpool_ptr, spool_ptr, slot_ptr,
                   o_ptr, s_ptr, c_ptr, H, K, R, s_xb, s_fb, s_bb, lower_bound, scale, eps,
                   W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    HK = H * K
    C = 3 * HK
    d = tl.arange(0, BLOCK_K)
    e = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    d_ok, e_ok = d < K, e < K
    slot = tl.load(slot_ptr + b).to(tl.int64)
    x_row, pool_row, new_row = x_ptr + b * s_xb, cpool_ptr + slot * (W - 1) * C, c_ptr + b * (W - 1) * C
    qk_write = d_ok & ((d * 0 + tl.program_id(1)) == 0)  # one program per head writes the q and k conv states
    q = _conv_silu(x_row, pool_row, cw_ptr, new_row, h * K + d, d_ok, qk_write, C, W)
    k = _conv_silu(x_row, pool_row, cw_ptr, new_row, HK + h * K + d, d_ok, qk_write, C, W)
    v = _conv_silu(x_row, pool_row, cw_ptr, new_row, 2 * HK + h * K + e, e_ok, e_ok, C, W)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))
    # the decay's up projection for this head's K channels, rounded as the layer's product rounds it
    z = tl.zeros((BLOCK_K,), tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R
        fa = tl.load(fa_ptr + b * s_fb + r, mask=r_ok, other=0.0).to(wfb_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(wfb_ptr + (h * K + d)[:, None] * R + r[None, :], mask=d_ok[:, None] & r_ok[None, :],
                    other=0.0).to(tl.float32)
        z += tl.sum(w * fa[None, :], axis=1)
    z = z.to(wfb_ptr.dtype.element_ty).to(tl.float32) + tl.load(dt_ptr + h * K + d, mask=d_ok, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    g = tl.where(d_ok, lower_bound / (1.0 + tl.exp(-a * z)), 0.0)  # padded rows: g = 0 keeps them at 0
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + b * s_bb + h).to(tl.float32)))
    mask = d_ok[:, None] & e_ok[None, :]
    offs = h * K * K + d[:, None] * K + e[None, :]
    S = tl.load(spool_ptr + slot * HK * K + offs, mask=mask, other=0.0).to(tl.float32)
    S = S * tl.exp(g)[:, None]
    pred = tl.sum(S * k[:, None], axis=0)
    S = S + (beta * k)[:, None] * (v - pred)[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(o_ptr + bh * K + e, o, mask=e_ok)
    tl.store(s_ptr + b * HK * K + offs, S, mask=mask)


def _tiles(B: int, H: int, K: int, cuda: bool) -> tuple[int, int]:
    """(BLOCK_V, warps). GPU: a decode step has few (batch row, head) pairs, so the state columns are split
    (down to 16) until there are a few hundred programs; a split head's small slice runs on 4 warps, a whole
    head on 2 (fewer registers a thread than on 4, more programs resident); tile sweep: docs/benchmarks.md.
    Interpreter: one tile."""
    bk = triton.next_power_of_2(K)
    if not cuda:
        return bk, 4
    bv = bk
    while bv > 16 and B * H * triton.cdiv(K, bv) < 256:
        bv //= 2
    return bv, 4 if bk * bv <= 1024 else 2


def kda_decode(projected, f_a, b, conv_weight, w_fb, A_log, dt_bias, lower_bound, conv_pool, state_pool, state_slots,
               scale=None):
    """One fused decode step: (o [B, H, K], new recurrent states [B, H, K, K], new conv states [B, W-1, 3HK]),
    fp32; see kda_decode_ref."""
    B, H, K, W = check_decode(projected, f_a, b, conv_weight, w_fb, A_log, dt_bias, conv_pool, state_pool, state_slots)
    tensors = (projected, f_a, b, conv_weight, w_fb, conv_pool, state_pool)
    if W < 2 or any(t.dtype == torch.float64 for t in tensors):  # no conv state / exactness tests only
        return kda_decode_ref(projected, f_a, b, conv_weight, w_fb, A_log, dt_bias, lower_bound, conv_pool,
                              state_pool, state_slots, scale)
    dev = projected.device
    o = torch.empty(B, H, K, dtype=torch.float32, device=dev)
    state = torch.empty(B, H, K, K, dtype=torch.float32, device=dev)
    conv = torch.empty(B, W - 1, 3 * H * K, dtype=torch.float32, device=dev)
    if B == 0:
        return o, state, conv
    projected, f_a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (projected, f_a, b))
    R = f_a.shape[1]
    scale = K ** -0.5 if scale is None else float(scale)
    bv, warps = _tiles(B, H, K, dev.type == "cuda")
    _decode_kernel[(B * H, triton.cdiv(K, bv))](
        projected, f_a, b, conv_weight.contiguous(), w_fb.contiguous(), A_log, dt_bias.contiguous(),
        conv_pool.contiguous(), state_pool.contiguous(), state_slots.contiguous(), o, state, conv,
        H, K, R, projected.stride(0), f_a.stride(0), b.stride(0), float(lower_bound), scale, L2_EPS,
        W=W, BLOCK_K=triton.next_power_of_2(K), BLOCK_V=bv, BLOCK_R=min(triton.next_power_of_2(R), 32),
        num_warps=warps)
    return o, state, conv
