"""Reference projections: ``F.linear`` without a bias, in the weight's dtype (the layers' own arithmetic), and the sum
of two such products of different inputs (``linear_sum``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import check_tensor
from .._dispatch import op


def check_linear(x: torch.Tensor, weight: torch.Tensor, xn: str = "x", wn: str = "weight") -> tuple[int, int]:
    """(K, N) after checking x [..., K] against weight [N, K] (same dtype and device); errors name them xn, wn."""
    K = check_tensor(xn, x, floating=True)[-1] if x.dim() else 0
    N, Kw = check_tensor(wn, weight, ndim=2, floating=True)
    if x.dim() == 0 or K != Kw:
        raise ValueError(f"{xn} has shape {tuple(x.shape)} and {wn} {tuple(weight.shape)}: {xn}'s last dim must be "
                         f"{wn}'s in_features {Kw}")
    if x.dtype != weight.dtype:
        raise TypeError(f"{xn} is {x.dtype} and {wn} {weight.dtype}; cast {xn} to {wn}'s dtype first")
    return K, N


@op(kernel="gemv_triton", fake=lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])))
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype (fp32 accumulation for bf16, as cuBLAS does)."""
    check_linear(x, weight)
    return F.linear(x, weight)


def check_linear_sum(x1: torch.Tensor, w1: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """(K1, K2, N) after checking both products and that their outputs can be added."""
    K1, N = check_linear(x1, w1, "x1", "w1")
    K2, N2 = check_linear(x2, w2, "x2", "w2")
    if N2 != N or x1.shape[:-1] != x2.shape[:-1] or w1.dtype != w2.dtype:
        raise ValueError(f"linear_sum: x1 {tuple(x1.shape)} @ w1 {tuple(w1.shape)} ({w1.dtype}) and x2 "
                         f"{tuple(x2.shape)} @ w2 {tuple(w2.shape)} ({w2.dtype}) must give outputs of one shape "
                         f"and dtype")
    return K1, K2, N


@op(kernel="gemv_triton", fake=lambda x1, w1, x2, w2: x1.new_empty((*x1.shape[:-1], w1.shape[0])))
def linear_sum(x1: torch.Tensor, w1: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x1 [..., K1] @ w1 [N, K1]^T + x2 [..., K2] @ w2 [N, K2]^T -> [..., N] in the weights' dtype: the two
    products as the layers compute them, then added (a kernel may add them before rounding)."""
    check_linear_sum(x1, w1, x2, w2)
    return F.linear(x1, w1) + F.linear(x2, w2)


# The plain references by the names the kernels' fallbacks and the tests call them.
linear_ref = linear.reference
linear_sum_ref = linear_sum.reference
