"""Reference Attention-Residual mixer: softmax over depth (docs/design.md §1).

Sources V_0..V_{N-1} (stored block representations plus the current partial sum) are scored by a
learned pseudo-query w against their RMS-normalised form; the output is their softmax-weighted
sum. With w = 0 every score is 0 and the mixer averages its sources.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import acc_dtype, cast, check_tensor
from .._dispatch import op
from .._library import result_like


def mix_call(impl, sources, query, norm_weight, eps=1e-5, return_weights=False):
    """How ``attn_res_mix`` calls its implementation: always asking for the depth weights too (one result type, as
    a custom op's schema needs; they cost N floats a row), returned only when asked for."""
    out = impl(sources, query, norm_weight, eps, True)
    return out if return_weights else out[0]


def check_mix_args(sources, query: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """The mixer's argument checks, shared by its kernel."""
    if not isinstance(sources, torch.Tensor) or sources.dim() < 2:
        raise ValueError(f"sources must be a tensor [N, ..., D] with N >= 1, got "
                         f"{tuple(sources.shape) if isinstance(sources, torch.Tensor) else type(sources).__name__}")
    check_tensor("sources", sources, floating=True)
    D = sources.shape[-1]
    if sources.shape[0] < 1:
        raise ValueError("sources is empty (N = 0); a mixer needs at least one source")
    check_tensor("query", query, shape=(D,), floating=True)
    check_tensor("norm_weight", norm_weight, shape=(D,), floating=True)


@op(kernel="mix_triton", call=mix_call, returns="(Tensor, Tensor)",
    fake=lambda sources, query, norm_weight, eps=1e-5, return_weights=False: (
        result_like(sources, sources.shape[1:]), result_like(sources, sources.shape[:-1])))
def attn_res_mix(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5,
                     return_weights: bool = False):
    """sources [N, ..., D], query [D], norm_weight [D] -> out [..., D] (fp32, fp64 kept).

    score_i = < RMSNorm_gamma(V_i), w >, alpha = softmax_i(score), out = sum_i alpha_i V_i.
    With ``return_weights`` also returns alpha [N, ...].
    """
    check_mix_args(sources, query, norm_weight)
    D = sources.shape[-1]
    acc = acc_dtype(sources, query, norm_weight)
    v = cast(sources, acc)
    normed = F.rms_norm(v, (D,), cast(norm_weight, acc), eps)  # v / sqrt(mean(v^2) + eps) * gamma
    scores = normed @ cast(query, acc)  # [N, ...]
    alpha = torch.softmax(scores, dim=0)
    out = (alpha.unsqueeze(-1) * v).sum(dim=0)
    return (out, alpha) if return_weights else out


def attn_res_block_scores(blocks: torch.Tensor, queries: torch.Tensor, norm_weights: torch.Tensor,
                          eps: float = 1e-5) -> torch.Tensor:
    """Phase 1 of two-phase Block AttnRes: every mixer of a block scored against the stored blocks at once.

    blocks [N, ..., D], queries [M, D], norm_weights [M, D] -> scores [M, N, ...] (fp32, fp64 kept).
    The stored blocks do not change inside a block, so these scores are computed once per block.
    """
    acc = acc_dtype(blocks, queries, norm_weights)
    v = blocks.to(acc)
    unit = v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)  # [N, ..., D]
    return torch.einsum("n...d,md->mn...", unit, queries.to(acc) * norm_weights.to(acc))


def attn_res_merge(blocks: torch.Tensor, block_scores: torch.Tensor, partial: torch.Tensor | None,
                   query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5,
                   return_weights: bool = False):
    """Phase 2: one mixer's output from its precomputed block scores [N, ...] and the current partial
    sum [..., D] (None when the mixer has no partial source), merged by online softmax.

    Equals ``attn_res_mix(cat(blocks, [partial]), query, norm_weight, eps)`` up to rounding.
    """
    acc = block_scores.dtype
    v = blocks.to(acc)
    m = block_scores.amax(dim=0)  # running max over the stored blocks
    e = torch.exp(block_scores - m)
    denom, num = e.sum(dim=0), (e.unsqueeze(-1) * v).sum(dim=0)
    if partial is None:
        out = num / denom.unsqueeze(-1)
        return (out, e / denom) if return_weights else out
    s_p = attn_res_block_scores(partial.unsqueeze(0), query.unsqueeze(0), norm_weight.unsqueeze(0), eps)[0, 0]
    m_new = torch.maximum(m, s_p)
    old, new = torch.exp(m - m_new), torch.exp(s_p - m_new)
    total = denom * old + new
    out = (num * old.unsqueeze(-1) + partial.to(acc) * new.unsqueeze(-1)) / total.unsqueeze(-1)
    if not return_weights:
        return out
    return out, torch.cat([e * old, new.unsqueeze(0)]) / total


# The plain references by the names the kernels' fallbacks and the tests call them.
attn_res_mix_ref = attn_res_mix.reference
