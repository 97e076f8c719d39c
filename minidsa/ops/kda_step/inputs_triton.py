"""Triton kernel of ``kda_inputs``: the contract of ``kda_inputs_ref`` in ``minidsa/ops/kda_step/reference.py``.

Between the short convs and the chunked recurrence a prefill computes, per token and head, the L2-normalised
q and k, the log-decay g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias)) and beta = sigmoid(b): about
eleven elementwise launches in plain torch, one here. A program takes ROWS (token, head) rows of K channels;
z and b are read through their row strides. The values agree with the reference to fp32 rounding (exp's and
sqrt's last bits, the order of a K-term sum), not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activation.situ_glu_triton import as_rows, sigmoid
from .checks import check_inputs
from .reference import L2_EPS, kda_inputs_ref

_TILE = 4096  # elements per program and tensor (ROWS x BLOCK_K)


@triton.jit(do_not_specialize_on_alignment=["n_rows"])
def _inputs_kernel(qkv_ptr, z_ptr, b_ptr, a_ptr, dt_ptr, q_ptr, k_ptr, g_ptr, beta_ptr, n_rows, H, K, stride_z,
                   stride_b, lower_bound, eps, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (token, head) rows
    c = tl.arange(0, BLOCK_K)
    row_ok = i < n_rows
    ok = row_ok[:, None] & (c < K)[None, :]
    t, h = i // H, i % H
    src = qkv_ptr + (t * 3 * H + h)[:, None] * K + c[None, :]  # q; k lies H * K further
    out = i[:, None] * K + c[None, :]
    for which in tl.static_range(2):
        x = tl.load(src + which * H * K, mask=ok, other=0.0).to(tl.float32)
        x = x / tl.sqrt(tl.sum(x * x, axis=1) + eps)[:, None]
        tl.store((q_ptr if which == 0 else k_ptr) + out, x, mask=ok)
    z = tl.load(z_ptr + t[:, None] * stride_z + (h[:, None] * K + c[None, :]), mask=ok, other=0.0).to(tl.float32)
    z += tl.load(dt_ptr + h[:, None] * K + c[None, :], mask=ok, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_ptr + h, mask=row_ok, other=0.0).to(tl.float32))
    tl.store(g_ptr + out, lower_bound * sigmoid(a[:, None] * z), mask=ok)
    beta = tl.load(b_ptr + t * stride_b + h, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(beta_ptr + i, sigmoid(beta), mask=row_ok)


def kda_inputs(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               lower_bound: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract of ``kda_inputs_ref``: qkv [..., 3, H, K], z [..., H*K], b [..., H] -> (q, k, g, beta) fp32."""
    H, K = check_inputs(qkv, z, b)
    if torch.float64 in (qkv.dtype, z.dtype, b.dtype, A_log.dtype, dt_bias.dtype):
        return kda_inputs_ref(qkv, z, b, A_log, dt_bias, lower_bound)
    lead = qkv.shape[:-3]
    q, k, g = (torch.empty((*lead, H, K), dtype=torch.float32, device=qkv.device) for _ in range(3))
    beta = torch.empty((*lead, H), dtype=torch.float32, device=qkv.device)
    n = q.numel() // K if K else 0
    if n == 0:
        return q, k, g, beta
    qkv = qkv if qkv.is_contiguous() else qkv.contiguous()
    z2, b2 = as_rows(z, H * K), as_rows(b, H)
    block_k = triton.next_power_of_2(K)
    per = max(1, _TILE // block_k) if qkv.is_cuda else 1  # the interpreter: one row a program
    _inputs_kernel[(triton.cdiv(n, per),)](qkv, z2, b2, A_log.contiguous(), dt_bias.contiguous(), q, k, g, beta, n,
                                           H, K, z2.stride(0), b2.stride(0), float(lower_bound), L2_EPS,
                                           ROWS=per, BLOCK_K=block_k)
    return q, k, g, beta
