"""Triton kernel of the Attention-Residual mixer (``reference.py``): one pass over the sources.

The reference makes about six full passes over its N sources (cast, RMS norm, score, softmax, weight, sum),
and each of a decoder's two mixers per layer runs them over every stored block: at prefill sizes the
mixers read and write more bytes than any sub-layer's glue. Here each program holds a few token rows: it
loads each source row once, scores it (v . (gamma * w) / rms(v), the same value as the reference's
<RMSNorm_gamma(v), w>), and folds it into the output by online softmax; the depth weights come from the
scores kept in registers. fp32 math; results agree with the reference to fp32 rounding. Tested in the
interpreter and compiled for sm_90 (tests/ops/test_kernels_compile.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import attn_res_mix_ref, check_mix_args


# The row count changes with every step: specialised on 1 only (a decode of one row), not on divisibility.
@triton.jit(do_not_specialize_on_alignment=["R"])
def _mix_kernel(src_ptr, q_ptr, gamma_ptr, out_ptr, alpha_ptr, N, R, D, source_stride, eps,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, N_PAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < R)[:, None] & (cols < D)[None, :]
    at = rows.to(tl.int64)[:, None] * D + cols[None, :]
    wg = tl.load(q_ptr + cols, mask=cols < D, other=0.0).to(tl.float32) * \
        tl.load(gamma_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    scores = tl.full([BLOCK_R, N_PAD], float("-inf"), tl.float32)
    depth = tl.arange(0, N_PAD)
    src = src_ptr + at  # 64-bit pointers: stepping them by one source never overflows an index
    for i in range(N):
        v = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        src += source_stride
        s = tl.sum(v * wg[None, :], 1) / tl.sqrt(tl.sum(v * v, 1) / D + eps)
        m_new = tl.maximum(m, s)
        shrink, p = tl.exp(m - m_new), tl.exp(s - m_new)
        acc = acc * shrink[:, None] + p[:, None] * v
        total = total * shrink + p
        m = m_new
        scores = tl.where(depth[None, :] == i, s[:, None], scores)
    tl.store(out_ptr + at, acc / total[:, None], mask=ok)
    alpha = tl.exp(scores - m[:, None]) / total[:, None]
    tl.store(alpha_ptr + depth[None, :].to(tl.int64) * R + rows[:, None], alpha,
             mask=(depth[None, :] < N) & (rows < R)[:, None])


def attn_res_mix(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5,
                 return_weights: bool = False):
    """The contract of ``attn_res_mix_ref``: sources [N, ..., D], query [D], norm_weight [D] -> out [..., D]
    fp32 (and alpha [N, ...] with ``return_weights``)."""
    check_mix_args(sources, query, norm_weight)
    if torch.float64 in (sources.dtype, query.dtype, norm_weight.dtype) or sources.shape[-1] == 0:
        return attn_res_mix_ref(sources, query, norm_weight, eps, return_weights)
    N, D = sources.shape[0], sources.shape[-1]
    src = sources.contiguous()
    R = src[0].numel() // D
    out = torch.empty(sources.shape[1:], dtype=torch.float32, device=sources.device)
    alpha = torch.empty(sources.shape[:-1], dtype=torch.float32, device=sources.device)
    if R:
        block_d = triton.next_power_of_2(D)
        block_r = max(1, min(16, 4096 // block_d, triton.next_power_of_2(R)))
        _mix_kernel[(triton.cdiv(R, block_r),)](src, query.contiguous(), norm_weight.contiguous(), out, alpha, N, R,
                                                D, R * D, float(eps), BLOCK_R=block_r, BLOCK_D=block_d,
                                                N_PAD=triton.next_power_of_2(N), num_warps=4 if block_d <= 2048 else 8)
    return (out, alpha) if return_weights else out
