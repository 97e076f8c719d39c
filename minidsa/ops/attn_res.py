"""Reference Attention-Residual mixer: softmax over depth (SPEC section 1).

Sources V_0..V_{N-1} (stored block representations plus the current partial sum) are scored by a
learned pseudo-query w against their RMS-normalised form; the output is their softmax-weighted
sum. With w = 0 every score is 0 and the mixer averages its sources.
"""

from __future__ import annotations

import torch

from ._checks import acc_dtype, check_tensor


def attn_res_mix_ref(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5,
                     return_weights: bool = False):
    """sources [N, ..., D], query [D], norm_weight [D] -> out [..., D] (fp32, fp64 kept).

    score_i = < RMSNorm_gamma(V_i), w >, alpha = softmax_i(score), out = sum_i alpha_i V_i.
    With ``return_weights`` also returns alpha [N, ...].
    """
    if not isinstance(sources, torch.Tensor) or sources.dim() < 2:
        raise ValueError(f"sources must be a tensor [N, ..., D] with N >= 1, got "
                         f"{tuple(sources.shape) if isinstance(sources, torch.Tensor) else type(sources).__name__}")
    check_tensor("sources", sources, floating=True)
    D = sources.shape[-1]
    if sources.shape[0] < 1:
        raise ValueError("sources is empty (N = 0); a mixer needs at least one source")
    check_tensor("query", query, shape=(D,), floating=True)
    check_tensor("norm_weight", norm_weight, shape=(D,), floating=True)
    acc = acc_dtype(sources, query, norm_weight)
    v = sources.to(acc)
    normed = v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight.to(acc)
    scores = normed @ query.to(acc)  # [N, ...]
    alpha = torch.softmax(scores, dim=0)
    out = (alpha.unsqueeze(-1) * v).sum(dim=0)
    return (out, alpha) if return_weights else out
