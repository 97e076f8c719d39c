"""Triton kernel of KDA's short conv with its SiLU (``short_conv_ref`` in reference.py): one pass.

In plain PyTorch the prefill conv is a concatenation with the state, W multiply-adds over the whole
[B, T, C] input, a SiLU and a gather of the next states: about 2W + 4 full passes in fp32, the largest
glue of a KDA layer's prefill. Here a program reads a [BT, BC] tile's W shifted windows (the first W-1
rows of a sequence from its state), writes SiLU(y) once, and the programs of each row's first tile also
write the W-1 inputs before that row's end as its next state. Results agree with the reference to fp32
rounding (the multiply-adds may fuse). Tested in the interpreter and compiled for sm_90
(tests/ops/test_kernels_compile.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_short_conv
from .reference import short_conv_ref

TILE = {"cuda": (32, 128), "cpu": (16, 32)}  # (BT tokens, BC channels) per program


@triton.jit
def _inputs(x_ptr, s_ptr, b, src, c, T, C, W: tl.constexpr, ok):
    """[len(src), BC] fp32: input positions ``src`` of row b (negative: the state's rows, -1 its last)."""
    cm = (c < C)[None, :]
    xv = tl.load(x_ptr + (b * T + src.to(tl.int64))[:, None] * C + c[None, :], mask=(ok & (src >= 0))[:, None] & cm,
                 other=0.0).to(tl.float32)
    srow = src + (W - 1)
    sv = tl.load(s_ptr + (b * (W - 1) + srow.to(tl.int64))[:, None] * C + c[None, :],
                 mask=(ok & (src < 0) & (srow >= 0))[:, None] & cm, other=0.0).to(tl.float32)
    return xv + sv


# The token count and the lengths' address (a slice of the step's metadata) vary from step to step: not
# specialised on, so a new step compiles no new variant.
@triton.jit(do_not_specialize_on_alignment=["T", "len_ptr"])
def _short_conv_kernel(x_ptr, w_ptr, s_ptr, len_ptr, y_ptr, ns_ptr, T, C, W: tl.constexpr, WP: tl.constexpr,
                       BT: tl.constexpr, BC: tl.constexpr, HAS_LEN: tl.constexpr):
    b, tb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tb * BT + tl.arange(0, BT)
    c = cb * BC + tl.arange(0, BC)
    y = tl.zeros([BT, BC], tl.float32)
    for i in tl.static_range(W):  # tap i reads input t + i - (W - 1)
        wi = tl.load(w_ptr + c * W + i, mask=c < C, other=0.0).to(tl.float32)
        y += _inputs(x_ptr, s_ptr, b, t + i - (W - 1), c, T, C, W, t < T) * wi[None, :]
    out = (b * T + t.to(tl.int64))[:, None] * C + c[None, :]
    tl.store(y_ptr + out, y / (1.0 + tl.exp(-y)), mask=(t < T)[:, None] & (c < C)[None, :])
    if tb == 0:  # the next state: the W-1 inputs before the row's end
        end = tl.load(len_ptr + b).to(tl.int32) if HAS_LEN else T
        j = tl.arange(0, WP)
        keep = _inputs(x_ptr, s_ptr, b, end - (W - 1) + j, c, T, C, W, j < W - 1)
        tl.store(ns_ptr + (b * (W - 1) + j.to(tl.int64))[:, None] * C + c[None, :], keep,
                 mask=(j < W - 1)[:, None] & (c < C)[None, :])


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
               lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of ``short_conv_ref``: x [B, T, C], weight [C, 1, W], state [B, W-1, C], lengths int [B]
    or None -> (SiLU(y) [B, T, C], the state at each row's end [B, W-1, C]), fp32."""
    B, T, C, W = check_short_conv(x, weight, state, lengths)
    if torch.float64 in (x.dtype, weight.dtype, state.dtype) or W < 2:
        return short_conv_ref(x, weight, state, lengths)
    y = torch.empty((B, T, C), dtype=torch.float32, device=x.device)
    new_state = torch.empty((B, W - 1, C), dtype=torch.float32, device=x.device)
    if B and C:
        bt, bc = TILE["cuda" if x.is_cuda else "cpu"]
        grid = (B, max(1, triton.cdiv(T, bt)), triton.cdiv(C, bc))
        _short_conv_kernel[grid](x.contiguous(), weight.contiguous(), state.contiguous(),
                                 lengths if lengths is not None else y, y, new_state, T, C, W=W,
                                 WP=triton.next_power_of_2(W - 1), BT=bt, BC=bc, HAS_LEN=lengths is not None)
    return y, new_state
