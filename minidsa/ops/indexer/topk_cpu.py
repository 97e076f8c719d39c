"""The indexer's causal top-k in a fast CPU form: same signature and result as ``topk_indices_ref``
(docs/design.md §2): int32 [B, T, topk], positions by descending score, equal scores to the lower
position, -1 padding after the candidates.

The reference orders every row by a stable full sort, O(S log S) per query; a prefill of T queries
over S keys spends most of its top-k time there. Here each (score, position) pair becomes one int64
key whose order is the answer's order, so every key is distinct and ``torch.topk`` (a partial
selection, no stability needed) returns exactly the reference's positions, already in order:

    key = s * 2^31 + (2^31 - 1 - position)          (a larger key is the better one)

with ``s`` the fp32 score's bits read as an int32 whose signed order is the float order: a
non-negative float keeps its bits, a negative one has its 31 low bits flipped, and -0.0 is read as
+0.0 first (the two are equal scores, so only the position may decide). The Triton kernel packs the
same pairs with the unsigned form of ``s`` (topk_triton.py). A non-candidate gets s = -2^31, the
pattern of a negative NaN only, so its key is below every candidate's, even one scored -inf; NaN
scores are rejected by the shared argument check. Every step is one pass in int32 or int64, in place
where it can be: the keys cost less than the selection.

fp64 scores (exactness tests) do not fit 32 bits of key: they go to the reference.
"""

from __future__ import annotations

import torch

from .checks import check_topk_args
from .reference import topk_indices_ref

_POS_BITS = 31  # positions below 2^31, as in the kernel


_NOT_CANDIDATE = -2 ** 31


def order_keys(scores: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """[..., S] float scores, bool candidate mask -> int64 keys: larger = better, ties by lower position."""
    S = scores.shape[-1]
    s = (scores.float() + 0.0).view(torch.int32)  # a fresh tensor (+ 0.0 turns -0.0 into +0.0)
    s ^= (s >> 31) & 0x7FFFFFFF  # negative floats: low bits flipped, so int order = float order
    s.masked_fill_(~candidate, _NOT_CANDIDATE)
    keys = s.to(torch.int64)
    keys <<= _POS_BITS
    keys |= 2 ** _POS_BITS - 1 - torch.arange(S, dtype=torch.int64, device=scores.device)
    return keys


def topk_indices(scores: torch.Tensor, topk: int, q_pos: torch.Tensor) -> torch.Tensor:
    """``topk_indices_ref``'s contract (see there); fp64 scores and rows of 2^31 keys or more go to it."""
    B, T, S = check_topk_args(scores, topk, q_pos)
    if scores.dtype == torch.float64 or S >= 2 ** _POS_BITS or B * T == 0:
        return topk_indices_ref(scores, topk, q_pos)
    pos = torch.arange(S, device=scores.device)
    candidate = pos.view(1, 1, S) <= q_pos.to(torch.long).unsqueeze(-1)  # padding rows (q_pos -1): none
    k_eff = min(topk, S)
    best = torch.topk(order_keys(scores.detach(), candidate), k_eff, dim=-1, sorted=True).values  # no gradient
    found = (best >> _POS_BITS) != _NOT_CANDIDATE
    idx = torch.where(found, (2 ** _POS_BITS - 1) - (best & (2 ** _POS_BITS - 1)), -1).to(torch.int32)
    if k_eff < topk:
        idx = torch.cat([idx, idx.new_full((B, T, topk - k_eff), -1)], dim=-1)
    return idx
