"""RMSNorm in fp32 (the weights stay fp32 in the real checkpoint too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import acc_dtype, cast


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype. x [..., D]."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = acc_dtype(x)
        # F.rms_norm is exactly the formula above (one call instead of six on the decode hot path).
        return cast(F.rms_norm(cast(x, acc), (x.shape[-1],), cast(self.weight, acc), self.eps), x.dtype)
