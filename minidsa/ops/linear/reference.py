"""Reference projection: ``F.linear`` without a bias, in the weight's dtype (the layers' own arithmetic)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import check_tensor


def check_linear(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """(K, N) after checking x [..., K] against weight [N, K] (same dtype and device)."""
    K = check_tensor("x", x, floating=True)[-1] if x.dim() else 0
    N, Kw = check_tensor("weight", weight, ndim=2, floating=True)
    if x.dim() == 0 or K != Kw:
        raise ValueError(f"x has shape {tuple(x.shape)} and weight {tuple(weight.shape)}: x's last dim must be "
                         f"the weight's in_features {Kw}")
    if x.dtype != weight.dtype:
        raise TypeError(f"x is {x.dtype} and weight {weight.dtype}; cast x to the weight's dtype first")
    return K, N


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype (fp32 accumulation for bf16, as cuBLAS does)."""
    check_linear(x, weight)
    return F.linear(x, weight)
