"""RMSNorm in fp32 (the weights stay fp32 in the real checkpoint too)."""

from __future__ import annotations

import torch
from torch import nn

from .. import ops


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype. x [..., D]."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``dtype``: the norm of x cast to it, in it (an fp32 residual into a bf16 layer: one pass, not two)."""
        return ops.rms_norm(x, self.weight, self.eps, dtype)
