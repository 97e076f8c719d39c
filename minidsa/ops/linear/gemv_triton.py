"""Triton kernel of ``linear`` for one row of x (a decode step of one sequence): the contract of
``linear_ref`` in ``minidsa/ops/linear/reference.py``; more rows go to ``F.linear``.

For x [1, K] against a weight [N, K] of this model's widths (N = 264-4,176, K = 64-4,096), cuBLAS picks
tiles of 64 outputs, so a 1024 x 1024 projection runs on 16 thread blocks: 2 MB streamed by an eighth of
the SMs. Here a program owns BLOCK_N whole rows
of the weight (two: the grid has hundreds to thousands of programs) and walks K in one or a few
vector loads per thread, multiplying in fp32 (a bf16 x bf16 product is exact in fp32) and summing each
row once at the end. Bound by the launch and one DRAM round trip at these sizes, which is why, on sm_90,
the kernels launch as programmatic dependents (``ops/_pdl.py``): a program loads its first weight tile,
then waits for the kernel that wrote x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .._pdl import launch_options, pdl
from .reference import check_linear, check_linear_sum


@triton.jit
def _rows_dot(acc, x_ptr, w_ptr, rows, row_ok, K, stride_wn, stride_wk, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] + the elementwise fp32 products of weight rows ``rows`` with x, walking K. PDL: the
    first step's weights are loaded before waiting for the kernel that wrote x (``ops/_pdl.py``)."""
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if PDL:
            if k0 == 0:
                gdc_wait()
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, stride_wk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = _rows_dot(tl.zeros((BLOCK_N, BLOCK_K), tl.float32), x_ptr, w_ptr, rows, row_ok, K, stride_wn, stride_wk,
                    BLOCK_K, PDL)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemv_sum_kernel(x_ptr, w_ptr, x2_ptr, w2_ptr, out_ptr, N, K, K2, stride_wn, stride_wk, stride_w2n, stride_w2k,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Both products' rows in one program, summed in fp32 and rounded once."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = _rows_dot(tl.zeros((BLOCK_N, BLOCK_K), tl.float32), x_ptr, w_ptr, rows, row_ok, K, stride_wn, stride_wk,
                    BLOCK_K, PDL)
    acc = _rows_dot(acc, x2_ptr, w2_ptr, rows, row_ok, K2, stride_w2n, stride_w2k, BLOCK_K, False)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=row_ok)


def _tiles(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps): two rows a program and K in 1-4 steps of up to 1024: the most
    programs in flight for a launch-and-latency-bound product, each a full-width vector load per thread (the
    tile sweep over rows, K steps and warps: docs/benchmarks.md, benchmarks/tune_decode.py)."""
    return 2, min(triton.next_power_of_2(K), 1024), 4


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N]: the kernel for one row of x, ``F.linear`` otherwise."""
    K, N = check_linear(x, weight)
    if x.numel() != K or x.dtype == torch.float64:
        return F.linear(x, weight)
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = _tiles(N, K)
    on = pdl(x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x.contiguous(), weight, out, N, K, weight.stride(0), weight.stride(1),
                                            BLOCK_N=block_n, BLOCK_K=block_k, PDL=on, num_warps=warps,
                                            **launch_options(on))
    return out


def linear_sum(x1: torch.Tensor, w1: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x1 @ w1^T + x2 @ w2^T -> [..., N]: one kernel for one row (the sum in fp32, rounded once), two
    ``F.linear`` calls and an add otherwise."""
    K1, K2, N = check_linear_sum(x1, w1, x2, w2)
    if x1.numel() != K1 or x1.dtype == torch.float64:
        return F.linear(x1, w1) + F.linear(x2, w2)
    out = torch.empty((*x1.shape[:-1], N), dtype=x1.dtype, device=x1.device)
    block_n, block_k, warps = _tiles(N, max(K1, K2))
    on = pdl(x1.device)
    _gemv_sum_kernel[(triton.cdiv(N, block_n),)](x1.contiguous(), w1, x2.contiguous(), w2, out, N, K1, K2,
                                                w1.stride(0), w1.stride(1), w2.stride(0), w2.stride(1),
                                                BLOCK_N=block_n, BLOCK_K=block_k, PDL=on, num_warps=warps,
                                                **launch_options(on))
    return out
