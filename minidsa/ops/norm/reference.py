"""Reference RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32 (fp64
kept) whatever x's dtype, returned in x's dtype. The checkpoint keeps the weights in fp32, and a bf16
model's activations come in bf16: the norm is where they meet, so the casts belong to the op. So does the
cast of an fp32 residual to the model's dtype before its norm (``dtype``): one pass instead of two."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import acc_dtype, cast, check_tensor
from .._dispatch import op


def check_rms_norm(x, weight, eps) -> int:
    """``rms_norm``'s argument checks (reference and kernel alike) -> D."""
    shape = check_tensor("x", x, floating=True)
    if not shape:
        raise ValueError("x must have at least one dim (the normalised one)")
    D = shape[-1]
    check_tensor("weight", weight, shape=(D,), floating=True)
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}")
    return D


@op(kernel="rms_triton", fake=lambda x, weight, eps, dtype=None: x.new_empty(x.shape, dtype=dtype or x.dtype))
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., D], weight [D], eps > 0 -> [..., D] in x's dtype: x / sqrt(mean(x^2) + eps) * weight in fp32
    (fp64 for fp64 inputs), one rounding to x's dtype at the end. ``dtype``: x is first cast to it (rounded,
    as ``x.to(dtype)``), and the result comes in it."""
    D = check_rms_norm(x, weight, eps)
    if dtype is not None:
        x = cast(x, dtype)
    acc = acc_dtype(x)
    return cast(F.rms_norm(cast(x, acc), (D,), cast(weight, acc), eps), x.dtype)


# The plain references by the names the kernels' fallbacks and the tests call them.
rms_norm_ref = rms_norm.reference
