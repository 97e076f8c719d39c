"""Triton kernels of SiTU-GLU forward and backward (``reference.py``): one elementwise pass each.

The forward reads g and u and writes h; the backward reads g, u and dLoss/dh and writes both input
gradients, recomputing tanh and sigmoid in registers. In plain torch the same backward is about twenty
full-size elementwise passes, so on a GPU (where a training step's SiTU-GLU tensors are the largest
activations) the fused pass is what makes recomputation cheaper than keeping intermediates. tanh is
built from exp (``_tanh``; relative error ~1e-7), so results agree with the references to fp32 rounding,
not bitwise. Inputs of any shape and float dtype, read in place where their rows are dense (a slice of
a fused projection's output); outputs fp32 and contiguous. The jit helpers ``_tanh``
and ``situ_glu_tl`` are also what the routed-expert kernels (``ops/moe_experts``) apply in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..norm.rms_triton import bf16_rne
from .reference import check_situ_glu_args, situ_glu_backward_ref, situ_glu_ref

BLOCK = {"cuda": 2048, "cpu": 64}


@triton.jit
def _tanh(x):
    """tanh from exp (no libdevice in the interpreter): odd Taylor series below |x| = 0.1, where
    (1 - e^-2|x|) / (1 + e^-2|x|) would cancel, that quotient above it (relative error ~1e-7)."""
    a = tl.abs(x)
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    e = tl.exp(-2.0 * a)
    t = tl.where(a < 0.1, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def sigmoid(x):
    """1 / (1 + e^-x) from e^-|x|, which cannot overflow (the gates of ``ops/gate`` and ``ops/kda``)."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def situ_glu_tl(g, u, beta_gate, beta_up):
    """beta_gate * tanh(g / beta_gate) * sigmoid(g) * beta_up * tanh(u / beta_up) (minidsa.model.ffn.situ_glu)."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    return (beta_gate * _tanh(g / beta_gate) * sig) * (beta_up * _tanh(u / beta_up))


@triton.jit
def _fwd_kernel(g_ptr, u_ptr, h_ptr, n, F, stride_g, stride_u, beta_gate, beta_up, RNE: tl.constexpr,
                BLOCK: tl.constexpr):
    """h [n / F, F] contiguous from g and u read as rows of F with their own row strides (slices of one fused
    projection's output need no copy)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    row, col = offs // F, offs % F
    g = tl.load(g_ptr + row * stride_g + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + col, mask=ok, other=0.0).to(tl.float32)
    h = situ_glu_tl(g, u, beta_gate, beta_up)
    if RNE:  # a bf16 result rounded as torch rounds (ties to even): the interpreter's .to truncates
        h = bf16_rne(h)
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_kernel(g_ptr, u_ptr, grad_ptr, dg_ptr, du_ptr, n, beta_gate, beta_up, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tg, tu = _tanh(g / beta_gate), _tanh(u / beta_up)
    sig = 1.0 / (1.0 + tl.exp(-g))
    a = beta_gate * tg * sig
    da = (1.0 - tg * tg) * sig + a * (1.0 - sig)
    tl.store(dg_ptr + offs, grad * (beta_up * tu) * da, mask=ok)
    tl.store(du_ptr + offs, grad * a * (1.0 - tu * tu), mask=ok)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


def as_rows(t: torch.Tensor, F: int) -> torch.Tensor:
    """t [..., F] as [R, F] rows with a row stride and dense columns: a view where the leading dimensions merge
    (a slice of a wider output, say), a copy otherwise. The elementwise kernels here and in ``ops/gate`` and
    ``ops/kda`` read their inputs so."""
    r = t.reshape(-1, F)
    return r if r.stride(-1) == 1 or F == 1 else r.contiguous()


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta_gate: float, beta_up: float,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """The contract of ``situ_glu_ref``: g, u [...] -> h [...] fp32, or in ``dtype``."""
    check_situ_glu_args(g, u)
    if torch.float64 in (g.dtype, u.dtype, dtype):
        return situ_glu_ref(g, u, beta_gate, beta_up, dtype)
    h = torch.empty(g.shape, dtype=dtype or torch.float32, device=g.device)
    n = h.numel()
    if n:
        block = BLOCK["cuda" if g.is_cuda else "cpu"]
        F = g.shape[-1] if g.dim() else 1
        g2, u2 = as_rows(g, F), as_rows(u, F)
        _fwd_kernel[(triton.cdiv(n, block),)](g2, u2, h.view(-1), n, g2.shape[1], g2.stride(0), u2.stride(0),
                                             float(beta_gate), float(beta_up), RNE=h.dtype == torch.bfloat16,
                                             BLOCK=block)
    return h


def situ_glu_backward(g: torch.Tensor, u: torch.Tensor, grad: torch.Tensor, beta_gate: float,
                      beta_up: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of ``situ_glu_backward_ref``: (dLoss/dg, dLoss/du) fp32, one fused pass."""
    check_situ_glu_args(g, u, grad)
    if torch.float64 in (g.dtype, u.dtype, grad.dtype):
        return situ_glu_backward_ref(g, u, grad, beta_gate, beta_up)
    dg = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    du = torch.empty_like(dg)
    n = dg.numel()
    if n:
        block = BLOCK["cuda" if g.is_cuda else "cpu"]
        _bwd_kernel[(triton.cdiv(n, block),)](_flat(g), _flat(u), _flat(grad), dg.view(-1), du.view(-1), n,
                                             float(beta_gate), float(beta_up), BLOCK=block)
    return dg, du
