"""The SiTU-GLU activation and the dense MLP built on it (docs/design.md §6).

SiTU-GLU(g, u) = [b_g * tanh(g / b_g) * sigmoid(g)] * [b_u * tanh(u / b_u)]: a SiLU-like gate and
a linear-like up branch, each soft-clipped by tanh, so |h| < b_g * b_u (= 100 for K3's 4 and 25).
The bound keeps activations inside the range low-precision expert weights can represent.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .. import ops
from ..ops import acc_dtype, cast
from .fused import FusedLinears


class _SituGluFn(torch.autograd.Function):
    """SiTU-GLU under autograd, keeping only (g, u): the backward is the op ``ops.situ_glu_backward``
    (one fused Triton pass on a GPU), instead of the six or so intermediates autograd would keep."""

    @staticmethod
    def forward(ctx, g, u, beta_gate, beta_up):
        ctx.save_for_backward(g, u)
        ctx.betas = (beta_gate, beta_up)
        return ops.situ_glu(g, u, beta_gate, beta_up)  # grad mode is off in here: a kernel may run

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        dg, du = ops.situ_glu_backward(g, u, grad, *ctx.betas)
        return dg.to(g.dtype), du.to(u.dtype), None, None


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """Elementwise on gate, up [..., F] -> [..., F]; computed in fp32 (fp64 kept), returned in gate's dtype."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        acc = acc_dtype(gate)
        return cast(_SituGluFn.apply(cast(gate, acc), cast(up, acc), beta_gate, beta_up), gate.dtype)
    # inference: the op, which upcasts as it reads and rounds as it writes (one pass on a GPU, no casts)
    return ops.situ_glu(gate, up, beta_gate, beta_up, gate.dtype)


class SituGluMLP(nn.Module):
    """down(SiTU-GLU(gate(x), up(x))). x [..., d] -> [..., d]."""

    parallel = None  # a distributed Comm when the intermediate channels are split over ranks

    def __init__(self, hidden: int, intermediate: int, beta_gate: float = 4.0, beta_up: float = 25.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.beta_gate, self.beta_up = beta_gate, beta_up
        self.input_proj = FusedLinears(self.gate_proj, self.up_proj)  # one product for both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(*self.input_proj(x))

    def finish(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """From the two projections (gate_proj(x), up_proj(x)) [..., I] on: down(SiTU-GLU(gate, up)) [..., d]."""
        out = ops.linear(situ_glu(gate, up, self.beta_gate, self.beta_up), self.down_proj.weight)
        return out if self.parallel is None else self.parallel.tp_all_reduce(out)  # row-parallel: partial sums
