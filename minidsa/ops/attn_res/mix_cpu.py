"""The Attention-Residual mixer in a fast CPU form: same signature and result as ``attn_res_mix_ref`` (to
fp32 rounding; fp64 kept), without the reference's [N, ..., D] temporaries.

The reference normalises every source (one [N, ..., D] tensor), scores it, then weights every source (a
second one) before summing: four full passes over the sources and two allocations of their size, which on a
CPU prefill cost as much as a projection. The weight folds into the query, and the RMS into a scalar per
source row:

    score_i = < V_i * gamma, w > / rms(V_i) = (V_i @ (gamma * w)) * rsqrt(|V_i|^2 / D + eps)

so the scores take one matrix-vector product and one norm per row, and the weighted sum adds the sources one
by one into the output. Each addition is a product then a sum (never ``addcmul``, whose fused and unfused
lanes round differently, so the bits would depend on how a thread's buffer is aligned). Like every CPU form
it also runs under autograd (``_dispatch.pick``): its ops are differentiable and it changes none that
autograd saves, so a forward gives the same bits with and without ``torch.no_grad``.
"""

from __future__ import annotations

import torch

from .._checks import acc_dtype, cast
from .reference import attn_res_mix_ref, check_mix_args


def attn_res_mix(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5,
                 return_weights: bool = False):
    """The contract of ``attn_res_mix_ref``: sources [N, ..., D], query [D], norm_weight [D] -> out [..., D]
    fp32 (and alpha [N, ...] with ``return_weights``)."""
    check_mix_args(sources, query, norm_weight)
    acc = acc_dtype(sources, query, norm_weight)
    v = cast(sources, acc)
    D = v.shape[-1]
    if D == 0:
        return attn_res_mix_ref(sources, query, norm_weight, eps, return_weights)
    inv_rms = (torch.linalg.vector_norm(v, dim=-1).square() / D + eps).rsqrt()  # [N, ...]; autograd keeps the norm
    scores = (v @ (cast(norm_weight, acc) * cast(query, acc))).mul_(inv_rms)
    alpha = torch.softmax(scores, dim=0)
    out = v[0] * alpha[0].unsqueeze(-1)
    for i in range(1, v.shape[0]):
        out += v[i] * alpha[i].unsqueeze(-1)
    return (out, alpha) if return_weights else out
