"""The decode projection kernels (one row; tiles of 2-64 rows) against ``F.linear`` (interpreter on CPU, compiled on
a GPU)."""

import pytest
import torch
from conftest import kernel_device

from minidsa import ops
from minidsa.ops.linear.reference import linear_ref

pytest.importorskip("triton")
from minidsa.ops.linear.gemv_triton import linear  # noqa: E402


@pytest.mark.parametrize("N,K", [(60, 63), (264, 256), (9, 1100)])  # odd widths; K past one 1024 step
def test_gemv_matches_reference_fp32(N, K):
    dev = kernel_device()
    g = torch.Generator().manual_seed(N + K)
    x, w = torch.randn(1, 1, K, generator=g), torch.randn(N, K, generator=g)
    got = linear(x.to(dev), w.to(dev)).cpu()
    want = linear_ref(x.double(), w.double())
    assert got.shape == (1, 1, N) and got.dtype == torch.float32
    # fp32 products summed in another order than the fp64 reference: K * 2^-24 * max|x w| relative
    assert (got.double() - want).abs().max() <= 1e-6 * K * (x.abs().max() * w.abs().max())


def test_gemv_bf16_and_strided_weight():
    dev = kernel_device()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 96, generator=g).bfloat16()
    stack = torch.randn(96, 70, generator=g).bfloat16()  # a K-major stack: weight [70, 96] with strides (1, 70)
    got = linear(x.to(dev), stack.to(dev).t()).cpu()
    want = x.double() @ stack.double()
    assert got.dtype == torch.bfloat16
    # exact bf16 products summed in fp32, then one conversion to bf16: within a bf16 spacing (2^-7 relative),
    # since the interpreter's conversion truncates (the GPU's rounds to nearest: half of that)
    assert ((got.double() - want).abs() <= 2 ** -7 * want.abs()).all()


@pytest.mark.parametrize("M,N,K", [(3, 60, 63), (5, 9, 1100)])
def test_fp32_rows_run_the_one_row_kernel_per_row(M, N, K):
    dev = kernel_device()
    g = torch.Generator().manual_seed(M + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    got = linear(x.to(dev), w.to(dev)).cpu()
    want = linear_ref(x.double(), w.double())
    assert got.shape == (M, N) and got.dtype == torch.float32
    # as for one row: fp32 sums against fp64, K * 2^-24 * max|x w| relative
    assert (got.double() - want).abs().max() <= 1e-6 * K * (x.abs().max() * w.abs().max())


def test_more_rows_go_to_f_linear_and_bad_shapes_are_named():
    from minidsa.ops.linear.gemv_triton import ROWS_MAX_WEIGHT_BYTES, TILE_MAX_ROWS
    x, w = torch.randn(TILE_MAX_ROWS + 1, 16), torch.randn(5, 16)  # a prefill
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    x, w = torch.randn(3, 1024), torch.randn(ROWS_MAX_WEIGHT_BYTES // 4096 + 1, 1024)  # a weight past L2's share
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    w = torch.randn(5, 16)
    with pytest.raises(ValueError, match="in_features 16"):
        ops.linear(torch.randn(1, 15), w)
    with pytest.raises(TypeError, match="cast x"):
        ops.linear(torch.randn(1, 16).double(), w)


def test_linear_sum_matches_reference():
    from minidsa.ops.linear.gemv_triton import linear_sum
    from minidsa.ops.linear.reference import linear_sum_ref
    dev = kernel_device()
    g = torch.Generator().manual_seed(5)
    N, K1, K2 = 63, 60, 1100  # odd rows and widths; the second product past one 1024 step
    x1, w1 = torch.randn(1, 1, K1, generator=g), torch.randn(N, K1, generator=g)
    x2, w2 = torch.randn(1, 1, K2, generator=g), torch.randn(N, K2, generator=g)
    got = linear_sum(*(t.to(dev) for t in (x1, w1, x2, w2))).cpu()
    want = linear_sum_ref(x1.double(), w1.double(), x2.double(), w2.double())
    assert got.shape == (1, 1, N) and got.dtype == torch.float32
    # one fp32 sum of K1 + K2 products against fp64: (K1 + K2) * 2^-24 * max|x w| relative, as for linear
    bound = 1e-6 * (K1 + K2) * max(x1.abs().max() * w1.abs().max(), x2.abs().max() * w2.abs().max())
    assert (got.double() - want).abs().max() <= bound
    # a strided second weight (a column slice of a wider matrix) reads the same rows
    wide = torch.randn(N, K2 + 7, generator=g)
    got = linear_sum(*(t.to(dev) for t in (x1, w1, x2)), wide.to(dev)[:, 3:3 + K2]).cpu()
    want = linear_sum_ref(x1.double(), w1.double(), x2.double(), wide[:, 3:3 + K2].double())
    assert (got.double() - want).abs().max() <= bound * 2


def test_linear_sum_rows_and_bad_inputs():
    from minidsa.ops.linear.gemv_triton import linear_sum
    x1, w1, x2, w2 = torch.randn(3, 16), torch.randn(5, 16), torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(linear_sum(x1, w1, x2, w2), torch.nn.functional.linear(x1, w1) + torch.nn.functional.linear(x2, w2))
    with pytest.raises(ValueError, match="in_features 8"):
        ops.linear_sum(x1, w1, x2[:, :7], w2)
    with pytest.raises(ValueError, match="one shape"):
        ops.linear_sum(x1, w1, x2, w2[:4])
    with pytest.raises(TypeError, match="cast x2"):
        ops.linear_sum(x1, w1, x2.double(), w2)


def _within_bf16(got, want, K, x, w):
    """A bf16 result of exact products summed in fp32: one bf16 spacing of |want| (2^-7 relative: the
    interpreter's conversion truncates), plus the fp32 sum's K * 2^-24 * max|x w| where terms cancel."""
    return ((got.double() - want).abs() <= 2 ** -7 * want.abs() + K * 2 ** -24 * x.abs().max() * w.abs().max()).all()


@pytest.mark.parametrize("M,N,K", [(3, 60, 63), (33, 17, 70)])  # odd rows, widths and depths; K past a step
def test_tile_kernel_rows_match_reference(M, N, K):
    from minidsa.ops.linear.gemv_triton import TILE_MAX_ROWS
    dev = kernel_device()
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, 1, K, generator=g).bfloat16()
    stack = torch.randn(K, N, generator=g).bfloat16()  # K-major, as the fused CPU stacks are
    got = linear(x.to(dev), stack.to(dev).t()).cpu()
    want = x.double() @ stack.double()
    assert got.shape == (M, 1, N) and got.dtype == torch.bfloat16 and M <= TILE_MAX_ROWS
    assert _within_bf16(got, want, K, x, stack)


def test_tile_kernel_sum_and_the_row_limit():
    from minidsa.ops.linear.gemv_triton import TILE_MAX_ROWS, linear_sum
    dev = kernel_device()
    g = torch.Generator().manual_seed(11)
    M, N, K1, K2 = 5, 63, 60, 40
    x1, w1 = torch.randn(M, K1, generator=g).bfloat16(), torch.randn(N, K1, generator=g).bfloat16()
    x2 = torch.randn(M, K2, generator=g).bfloat16()
    wide = torch.randn(N, K2 + 7, generator=g).bfloat16()  # a strided second weight: a column slice
    got = linear_sum(x1.to(dev), w1.to(dev), x2.to(dev), wide.to(dev)[:, 3:3 + K2]).cpu()
    want = x1.double() @ w1.double().t() + x2.double() @ wide[:, 3:3 + K2].double().t()
    # one fp32 sum of both products, rounded once
    assert got.dtype == torch.bfloat16 and _within_bf16(got, want, K1 + K2, torch.cat([x1, x2], 1), wide)
    # past the limit (a prefill) the rows go to F.linear, in cuBLAS's own order
    x = torch.randn(TILE_MAX_ROWS + 1, 16, generator=g).bfloat16()
    w = torch.randn(8, 16, generator=g).bfloat16()
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
