"""Triton kernel of ``output_gate``: the contract of ``output_gate_ref`` in ``minidsa/ops/gate/reference.py``.

A program takes ROWS (token, head) rows of K values: the norm's mean of squares in registers, the gate read
through its own row stride (a slice of the layer's fused input projection needs no copy), the sigmoid in
fp32 from e^-|g| (no overflow), and a bf16 result rounded by the bits (ties to even, as torch rounds; the
interpreter's ``.to`` truncates). Five launches of a decode step's layer become one; the values agree with
the reference to fp32 rounding (exp's last bits, the order of the norm's sum), not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activation.situ_glu_triton import as_rows, sigmoid
from ..norm.rms_triton import bf16_rne
from .reference import check_output_gate, output_gate_ref

_TILE = 4096  # elements a program gates (ROWS x BLOCK_K)


@triton.jit(do_not_specialize_on_alignment=["n_rows"])
def _gate_kernel(o_ptr, g_ptr, w_ptr, y_ptr, n_rows, H, K, stride_g, eps, NORM: tl.constexpr, RNE: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (token, head) rows
    c = tl.arange(0, BLOCK_K)
    ok = (i < n_rows)[:, None] & (c < K)[None, :]
    x = tl.load(o_ptr + i[:, None] * K + c[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / K + eps)
        x = x * inv[:, None] * tl.load(w_ptr + c, mask=c < K, other=0.0).to(tl.float32)[None, :]
    row, head = i // H, i % H
    g = tl.load(g_ptr + row[:, None] * stride_g + head[:, None] * K + c[None, :], mask=ok, other=0.0).to(tl.float32)
    y = x * sigmoid(g)
    if RNE:
        y = bf16_rne(y)
    tl.store(y_ptr + i[:, None] * K + c[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def output_gate(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float,
                dtype: torch.dtype) -> torch.Tensor:
    """The contract of ``output_gate_ref``: o [..., H, K], gate [..., H*K] -> [..., H*K] in ``dtype``."""
    H, K = check_output_gate(o, gate, weight, eps)
    if torch.float64 in (o.dtype, gate.dtype, dtype) or (weight is not None and weight.dtype == torch.float64):
        return output_gate_ref(o, gate, weight, eps, dtype)
    y = torch.empty(gate.shape, dtype=dtype, device=o.device)
    n = o.numel() // K if K else 0
    if n == 0:
        return y
    rows, g = o.reshape(-1, K).contiguous(), as_rows(gate, H * K)
    block_k = triton.next_power_of_2(K)
    per = max(1, _TILE // block_k) if o.is_cuda else 1  # the interpreter: one row a program
    _gate_kernel[(triton.cdiv(n, per),)](rows, g, rows if weight is None else weight.contiguous(), y, n, H, K,
                                         g.stride(0), float(eps), NORM=weight is not None,
                                         RNE=dtype == torch.bfloat16, ROWS=per, BLOCK_K=block_k)
    return y
