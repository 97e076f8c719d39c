"""Reference ops of the DSA lightning indexer: scores and top-k selection (SPEC section 2).

fp32 math on any device; loops kept out only where a broadcast reads as clearly.
"""

from __future__ import annotations

import torch

from ._checks import acc_dtype, check_tensor


def index_scores_ref(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """I[b,t,s] = sum_h w[b,t,h] * ReLU(scale * q[b,t,h,:] . k[b,s,:]), no causal masking.

    Args:
        q: [B, T, H, D] indexer queries (one per indexer head).
        k: [B, S, D] indexer keys, one per token, shared by all heads.
        w: [B, T, H] signed per-head weights (the model folds H^-0.5 into them).
        scale: the D^-0.5 factor inside the ReLU.
    Returns:
        [B, T, S] float32 (float64 if an input is).
    The ReLU is taken per head, before the signed weight: ReLU of the weighted sum is a different
    (and wrong) function (SPEC section 10, trap 2).
    """
    B, T, H, D = check_tensor("q", q, ndim=4, floating=True)
    check_tensor("k", k, shape=(B, None, D), floating=True)
    check_tensor("w", w, shape=(B, T, H), floating=True)
    acc = acc_dtype(q, k, w)
    logits = torch.einsum("bthd,bsd->bths", q.to(acc), k.to(acc)) * float(scale)
    return torch.einsum("bths,bth->bts", torch.relu(logits), w.to(acc))


def topk_indices_ref(scores: torch.Tensor, topk: int, q_pos: torch.Tensor) -> torch.Tensor:
    """Top-k key positions per query among the causal candidates 0..q_pos (itself included).

    Args:
        scores: [B, T, S] index scores (any float dtype; NaN is rejected).
        topk: keys to keep per query, >= 1.
        q_pos: [B, T] integer absolute position of each query.
    Returns:
        int32 [B, T, topk]: positions ordered by descending score, ties broken by the lower position;
        when fewer than ``topk`` candidates exist the row is padded with -1 at the end (never with a
        future position: SPEC section 10, trap 3).
    """
    B, T, S = check_tensor("scores", scores, ndim=3, floating=True)
    check_tensor("q_pos", q_pos, shape=(B, T), integer=True)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if torch.isnan(scores).any():
        raise ValueError("scores contain NaN; top-k of NaN is undefined (check the indexer inputs)")
    pos = torch.arange(S, device=scores.device)
    candidate = pos.view(1, 1, S) <= q_pos.to(torch.long).unsqueeze(-1)  # [B, T, S]
    # Non-candidates sort after every candidate: -inf ties with a candidate scored -inf, and a
    # stable sort then keeps the lower position (every candidate) first.
    masked = torch.where(candidate, scores, torch.tensor(float("-inf"), device=scores.device))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices  # ties -> lower position
    k_eff = min(topk, S)
    idx = order[..., :k_eff]
    valid = torch.gather(candidate, -1, idx)
    idx = torch.where(valid, idx, torch.full_like(idx, -1)).to(torch.int32)
    if k_eff < topk:
        pad = torch.full((B, T, topk - k_eff), -1, dtype=torch.int32, device=scores.device)
        idx = torch.cat([idx, pad], dim=-1)
    return idx
