"""Reference output gate (docs/design.md §2, §3): what an attention layer applies between its core and W_o.

    y = N(o) * sigmoid(gate),  N = RMSNorm over each head's K values with ``weight`` (KDA), or identity (MLA)

o comes from the attention core in the accumulation dtype, gate is the layer's own projection of its input
(the model's dtype), and y feeds W_o in the model's dtype: the gate is where the three dtypes meet.
"""

from __future__ import annotations

import torch

from .._checks import acc_dtype, cast, check_tensor
from .._dispatch import op
from ..norm.reference import rms_norm_ref


def check_output_gate(o, gate, weight, eps) -> tuple[int, int]:
    """(H, K) after checking ``output_gate``'s arguments."""
    shape = check_tensor("o", o, floating=True)
    if len(shape) < 2:
        raise ValueError(f"o must be [..., H, K] (heads, head width), got shape {tuple(shape)}")
    H, K = shape[-2:]
    check_tensor("gate", gate, shape=(*shape[:-2], H * K), floating=True)
    if weight is not None:
        check_tensor("weight", weight, shape=(K,), floating=True)
        if not eps > 0:
            raise ValueError(f"eps must be positive, got {eps!r}")
    return H, K


@op(kernel="gate_triton", fake=lambda o, gate, weight, eps, dtype: gate.new_empty(gate.shape, dtype=dtype))
def output_gate(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """o [..., H, K], gate [..., H*K], weight [K] or None -> [..., H*K] in ``dtype``: each head of o normalised
    (RMSNorm with ``weight``, in o's dtype as ``rms_norm``; skipped for None), times sigmoid(gate) computed in
    the accumulation dtype (fp32, fp64 kept), one rounding to ``dtype`` at the end."""
    check_output_gate(o, gate, weight, eps)
    x = o if weight is None else rms_norm_ref(o, weight, eps)
    return cast(x.reshape(gate.shape) * torch.sigmoid(cast(gate, acc_dtype(o))), dtype)


# The plain references by the names the kernels' fallbacks and the tests call them.
output_gate_ref = output_gate.reference
