"""Triton kernel of RMSNorm (``reference.py``): x [..., D] -> [..., D] in x's dtype, fp32 inside.

Over PyTorch this saves the two casts around the norm (a bf16 model's activation read, widened to fp32,
written, read again by the norm, its fp32 result written and read once more for the cast back): one
read of x and one write of y, one launch instead of three or more. One program normalises ROWS rows of
the whole width D at once (BLOCK_D = the next power of two >= D), so small widths (the MoE latent, the
query and KV ranks) still give each program a few KB of work. Results agree with the reference to fp32
rounding (the mean is summed in a different order), so a bf16 output can differ from it by one unit in
the last place.

fp64 inputs (exactness tests) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_rms_norm, rms_norm_ref

_TILE = 4096  # elements a program normalises (ROWS x BLOCK_D), for widths up to it


@triton.jit
def bf16_rne(x):
    """fp32 -> the nearest bf16 value (ties to even), held in fp32. By the bits, not by ``.to``: Triton's
    interpreter truncates that conversion, the GPU rounds it; this agrees with torch on both. NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


# The row count changes with every step: specialised on 1 only (a decode of one row), not on divisibility.
@triton.jit(do_not_specialize_on_alignment=["n_rows"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n_rows, D, stride_x, eps, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                     ROUND: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if ROUND:  # fp32 x rounded to bf16 first, as Tensor.to(torch.bfloat16) would
        x = bf16_rne(x)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = x * inv[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The contract of ``rms_norm_ref``: x [..., D], weight [D] -> [..., D] in ``dtype`` (default x's), x rounded
    to it first."""
    D = check_rms_norm(x, weight, eps)
    out = x.dtype if dtype is None else dtype
    if torch.float64 in (x.dtype, weight.dtype, out):
        return rms_norm_ref(x, weight, eps, dtype)
    round_in = out != x.dtype
    if round_in and (x.dtype, out) != (torch.float32, torch.bfloat16):  # rounded in registers: fp32 -> bf16 only
        x, round_in = x.to(out), False
    rows = x.reshape(-1, D) if D else x.reshape(0, 0)
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    y = torch.empty(x.shape, dtype=out, device=x.device)
    n = rows.shape[0]
    if n and D:
        block_d = triton.next_power_of_2(D)
        per = max(1, _TILE // block_d) if x.is_cuda else 1  # the interpreter: one row a program, small tiles
        _rms_norm_kernel[(triton.cdiv(n, per),)](rows, weight.contiguous(), y, n, D, rows.stride(0), float(eps),
                                                  BLOCK_D=block_d, ROWS=per, ROUND=round_in,
                                                  num_warps=8 if block_d >= 4096 else 4)
    return y
