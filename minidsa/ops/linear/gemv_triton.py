"""Triton kernels of ``linear`` and ``linear_sum`` for the few rows of x of a decode step: the contracts of
``linear_ref`` and ``linear_sum_ref`` in ``minidsa/ops/linear/reference.py``; larger x goes to ``F.linear``.

*One row* (a decode step of one sequence). For x [1, K] against a weight [N, K] of this model's widths
(N = 264-4,176, K = 64-4,096), cuBLAS picks tiles of 64 outputs, so a 1024 x 1024 projection runs on 16
thread blocks: 2 MB streamed by an eighth of the SMs. Here a program owns BLOCK_N whole rows of the weight
(two: the grid has hundreds to thousands of programs) and walks K in one or a few vector loads per thread,
multiplying in fp32 (a bf16 x bf16 product is exact in fp32) and summing each row once at the end.

*2 to 64 rows* (a decode batch), bf16 or fp16: tensor-core tiles with the weight rows as the dot's M and
x's rows as its N, 16 weight rows a program, so that the grid still has N / 16 programs (cuBLAS's tiles
at these shapes leave most SMs idle or split K and add a reduction kernel). Products in fp32 as cuBLAS
does; the sums run in another order, so results differ from ``F.linear`` by fp32 rounding before the
final conversion. Other dtypes (the fp32 router) against a weight of at most 256 KiB: the one-row kernel
once per row, the weight read from L2 after the first; fp32 products on tensor cores would be TF32, which
can flip a routing choice.

Both are bound by the launch and one DRAM round trip at these sizes, which is why, on sm_90, the kernels
launch as programmatic dependents (``ops/_pdl.py``): a program loads its first weight tile, then waits
for the kernel that wrote x.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .._pdl import launch_options, use_pdl
from .reference import check_linear, check_linear_sum

# A decode batch of 2 to TILE_MAX_ROWS rows runs the tile kernel (tensor cores, 16-bit inputs); more rows are a
# prefill, where cuBLAS's large tiles fill the GPU.
TILE_MAX_ROWS = 64
TILE_DTYPES = (torch.bfloat16, torch.float16)
# Other dtypes (the fp32 router) at 2 to TILE_MAX_ROWS rows take the matrix-vector kernel once per row when the
# weight is this small: it stays in L2 after the first row's programs, and cuBLAS runs these shapes as SIMT
# sgemms with a split-K reduction (tensor-core fp32 products would be TF32). The limit is the small config's
# router (64 x 1024 in fp32), the shape this was tuned on; larger weights keep cuBLAS.
ROWS_MAX_WEIGHT_BYTES = 256 << 10


@triton.jit
def _rows_step(acc, x_ptr, w_ptr, rows, row_ok, k0, K, stride_wn, stride_wk, BLOCK_K: tl.constexpr,
               WAIT: tl.constexpr):
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < K
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk,
                mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if WAIT:
        gdc_wait()
    x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    return acc + w * x[None, :]


@triton.jit
def _rows_dot(acc, x_ptr, w_ptr, rows, row_ok, K, stride_wn, stride_wk, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] + the elementwise fp32 products of weight rows ``rows`` with x, walking K. PDL: the
    first step's weights are loaded before waiting for the kernel that wrote x (``ops/_pdl.py``). That step is
    peeled off the loop, so no load the compiler pipelines out of the loop can move above the wait."""
    acc = _rows_step(acc, x_ptr, w_ptr, rows, row_ok, 0, K, stride_wn, stride_wk, BLOCK_K, PDL)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        acc = _rows_step(acc, x_ptr, w_ptr, rows, row_ok, k0, K, stride_wn, stride_wk, BLOCK_K, False)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, stride_wk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """out[m] = W @ x[m] for the row m = program_id(1) of a contiguous x."""
    if PDL:
        gdc_launch_dependents()
    m = tl.program_id(1).to(tl.int64)
    x_ptr += m * K
    out_ptr += m * N
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


@triton.jit
def _tile_step(acc, x_ptr, w_ptr, rows, row_ok, t, t_ok, k0, K, stride_xm, stride_wn, stride_wk,
               BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WAIT: tl.constexpr):
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < K
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk,
                mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if WAIT:
        gdc_wait()
    x_t = tl.load(x_ptr + t[None, :].to(tl.int64) * stride_xm + k[:, None], mask=k_ok[:, None] & t_ok[None, :],
                  other=0.0)
    if IEEE:
        return tl.dot(w.to(tl.float32), x_t.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, x_t, acc)


@triton.jit
def _tile_dot(acc, x_ptr, w_ptr, rows, row_ok, t, t_ok, K, stride_xm, stride_wn, stride_wk, BLOCK_K: tl.constexpr,
              IEEE: tl.constexpr, PDL: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + W[rows] @ x[t]^T, walking K; the first step peeled off as in ``_rows_dot``."""
    acc = _tile_step(acc, x_ptr, w_ptr, rows, row_ok, t, t_ok, 0, K, stride_xm, stride_wn, stride_wk, BLOCK_K, IEEE,
                     PDL)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        acc = _tile_step(acc, x_ptr, w_ptr, rows, row_ok, t, t_ok, k0, K, stride_xm, stride_wn, stride_wk, BLOCK_K,
                         IEEE, False)
    return acc


@triton.jit
def _tile_kernel(x_ptr, w_ptr, x2_ptr, w2_ptr, out_ptr, M, N, K, K2, stride_wn, stride_wk, stride_w2n, stride_w2k,
                 TWO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, PDL: tl.constexpr):
    """out [M, N] = x [M, K] @ W^T (+ x2 [M, K2] @ W2^T when TWO) for a few rows of x: the weight rows are the
    dot's M, x's rows its N (padded to BLOCK_M by masked lanes)."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    t = tl.arange(0, BLOCK_M)
    t_ok = t < M
    acc = _tile_dot(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), x_ptr, w_ptr, rows, row_ok, t, t_ok, K, K, stride_wn,
                    stride_wk, BLOCK_K, IEEE, PDL)
    if TWO:
        acc = _tile_dot(acc, x2_ptr, w2_ptr, rows, row_ok, t, t_ok, K2, K2, stride_w2n, stride_w2k, BLOCK_K, IEEE,
                        False)
    tl.store(out_ptr + t[None, :].to(tl.int64) * N + rows[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & t_ok[None, :])


def _tiles(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps): two rows a program and K in 1-4 steps of up to 1024: the most
    programs in flight for a launch-and-latency-bound product, each a full-width vector load per thread (the
    tile sweep over rows, K steps and warps: docs/benchmarks.md, benchmarks/diagnostics/tune_decode.py)."""
    return 2, min(triton.next_power_of_2(K), 1024), 4


def _tile_config(M: int, on_gpu: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the tile kernel for M rows of x: 16 weight rows a program,
    the smallest tensor-core tile, so that even a 1024-row weight spreads over 64 programs (the sweep:
    benchmarks/diagnostics/tune_decode.py). The interpreter gets the smallest legal tiles."""
    block_m = max(16, triton.next_power_of_2(M))
    if not on_gpu:
        return block_m, 16, 32, 4, 1
    return block_m, 16, 128, 2, 4


def _rows_of(x: torch.Tensor, K: int) -> int:
    return x.numel() // K if K else 0


def _tile_launch(x1, w1, x2, w2, M, N, K1, K2) -> torch.Tensor:
    out = torch.empty((*x1.shape[:-1], N), dtype=x1.dtype, device=x1.device)
    on_gpu = x1.is_cuda
    block_m, block_n, block_k, warps, stages = _tile_config(M, on_gpu)
    on = use_pdl(x1.device)
    two = x2 is not None
    x1 = x1.reshape(M, K1).contiguous()
    if two:
        x2 = x2.reshape(M, K2).contiguous()
    else:  # TWO=False reads none of them
        x2, w2, K2 = x1, w1, K1
    extra = dict(num_stages=stages) if on_gpu else {}
    # fp32 inputs (a tuning sweep) are multiplied in fp32, not TF32; the interpreter's bf16 dot is wrong
    ieee = not on_gpu or x1.dtype not in TILE_DTYPES
    _tile_kernel[(triton.cdiv(N, block_n),)](x1, w1, x2, w2, out, M, N, K1, K2, w1.stride(0), w1.stride(1),
                                             w2.stride(0), w2.stride(1), TWO=two, BLOCK_M=block_m, BLOCK_N=block_n,
                                             BLOCK_K=block_k, IEEE=ieee, PDL=on,
                                             num_warps=warps, **extra, **launch_options(on))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N]: the matrix-vector kernel for one row of x, the tile kernel for
    2 to ``TILE_MAX_ROWS`` rows in bf16 or fp16, the matrix-vector kernel per row for as many rows of other
    dtypes against a weight of at most ``ROWS_MAX_WEIGHT_BYTES``, ``F.linear`` otherwise."""
    K, N = check_linear(x, weight)
    M = _rows_of(x, K)
    few = 1 < M <= TILE_MAX_ROWS
    if few and x.dtype in TILE_DTYPES:
        return _tile_launch(x, weight, None, None, M, N, K, 0)
    if x.dtype == torch.float64 or not (M == 1 or (few and weight.nbytes <= ROWS_MAX_WEIGHT_BYTES)):
        return F.linear(x, weight)
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = _tiles(N, K)
    on = use_pdl(x.device)
    _gemv_kernel[(triton.cdiv(N, block_n), M)](x.contiguous(), weight, out, N, K, weight.stride(0), weight.stride(1),
                                            BLOCK_N=block_n, BLOCK_K=block_k, PDL=on, num_warps=warps,
                                            **launch_options(on))
    return out


def linear_sum(x1: torch.Tensor, w1: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x1 @ w1^T + x2 @ w2^T -> [..., N]: one kernel (the sum in fp32, rounded once) for one row of any dtype but
    fp64 and for 2 to ``TILE_MAX_ROWS`` rows in bf16 or fp16; two ``F.linear`` calls and an add otherwise."""
    K1, K2, N = check_linear_sum(x1, w1, x2, w2)
    M = _rows_of(x1, K1)
    if 1 < M <= TILE_MAX_ROWS and x1.dtype in TILE_DTYPES:
        return _tile_launch(x1, w1, x2, w2, M, N, K1, K2)
    if M != 1 or x1.dtype == torch.float64:
        return F.linear(x1, w1) + F.linear(x2, w2)
    out = torch.empty((*x1.shape[:-1], N), dtype=x1.dtype, device=x1.device)
    block_n, block_k, warps = _tiles(N, max(K1, K2))
    on = use_pdl(x1.device)
    _gemv_sum_kernel[(triton.cdiv(N, block_n),)](x1.contiguous(), w1, x2.contiguous(), w2, out, N, K1, K2,
                                                w1.stride(0), w1.stride(1), w2.stride(0), w2.stride(1),
                                                BLOCK_N=block_n, BLOCK_K=block_k, PDL=on, num_warps=warps,
                                                **launch_options(on))
    return out
