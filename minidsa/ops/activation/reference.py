"""Reference SiTU-GLU activation and its derivative (docs/design.md §6), the elementwise core of every
MLP and expert:

    h = A(g) B(u),   A(g) = b_g tanh(g / b_g) sigmoid(g),   B(u) = b_u tanh(u / b_u)
    dh/dg = B(u) [(1 - tanh^2(g / b_g)) sigmoid(g) + A(g) (1 - sigmoid(g))],   dh/du = A(g) (1 - tanh^2(u / b_u))

The backward is an op of its own so that training can keep only (g, u) for it and recompute the rest:
autograd through the forward expression would keep about six [..., F] intermediates per call, the
largest activations of a training step. Inputs in any float dtype; math in fp32 (fp64 kept).
"""

from __future__ import annotations

import torch

from .._checks import acc_dtype, cast, check_tensor
from .._dispatch import op
from .._library import result_like


def check_situ_glu_args(g, u, *more) -> None:
    shape = check_tensor("g", g, floating=True)
    check_tensor("u", u, shape=shape, floating=True)
    for t in more:
        check_tensor("grad", t, shape=shape, floating=True)


def situ_glu_values(g: torch.Tensor, u: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    """The expression itself on float tensors, unchecked (the MoE expert ops evaluate it inside their core)."""
    return (beta_gate * torch.tanh(g / beta_gate) * torch.sigmoid(g)) * (beta_up * torch.tanh(u / beta_up))


@op(kernel="situ_glu_triton", fake=lambda g, u, beta_gate, beta_up, dtype=None: result_like(g, g.shape, dtype))
def situ_glu(g: torch.Tensor, u: torch.Tensor, beta_gate: float, beta_up: float,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """g, u [...] -> h [...] in fp32 (fp64 if g or u is), computed so; ``dtype``: h rounded to it once at the end
    (the product that reads h wants the model's dtype)."""
    check_situ_glu_args(g, u)
    acc = acc_dtype(g, u)
    h = situ_glu_values(cast(g, acc), cast(u, acc), beta_gate, beta_up)
    return h if dtype is None else cast(h, dtype)


@op(kernel="situ_glu_triton",
    fake=lambda g, u, grad, beta_gate, beta_up: (result_like(g, g.shape), result_like(g, g.shape)))
def situ_glu_backward(g: torch.Tensor, u: torch.Tensor, grad: torch.Tensor, beta_gate: float,
                          beta_up: float) -> tuple[torch.Tensor, torch.Tensor]:
    """g, u, grad (dLoss/dh) [...] -> (dLoss/dg, dLoss/du) [...] in fp32 (fp64 if any input is)."""
    check_situ_glu_args(g, u, grad)
    acc = acc_dtype(g, u, grad)
    g, u, grad = cast(g, acc), cast(u, acc), cast(grad, acc)
    tg, tu, sig = torch.tanh(g / beta_gate), torch.tanh(u / beta_up), torch.sigmoid(g)
    a = beta_gate * tg * sig
    da = (1 - tg * tg) * sig + a * (1 - sig)
    return grad * (beta_up * tu) * da, grad * a * (1 - tu * tu)


# The plain references by the names the kernels' fallbacks and the tests call them.
situ_glu_ref = situ_glu.reference
situ_glu_backward_ref = situ_glu_backward.reference
