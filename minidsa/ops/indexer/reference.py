"""Reference ops of the DSA lightning indexer: scores, scores over a paged key plane, and top-k
selection (docs/design.md §2).

fp32 math on any device. ``paged_index_scores`` is ``index_scores`` after gathering each sequence's
keys through its block table; tests hold the two equal.
"""

from __future__ import annotations

import torch

from .._checks import acc_dtype, check_tensor
from .._dispatch import op
from .._library import result_like
from ..paging import gather_kv_slots, paged_kv_slots
from .checks import check_paged_scores_args, check_topk_args


@op(kernel="scores_triton", fake=lambda q, k, w, scale: result_like(q, (*q.shape[:2], k.shape[1])))
def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """I[b,t,s] = sum_h w[b,t,h] * ReLU(scale * q[b,t,h,:] . k[b,s,:]), no causal masking.

    Args:
        q: [B, T, H, D] indexer queries (one per indexer head).
        k: [B, S, D] indexer keys, one per token, shared by all heads.
        w: [B, T, H] signed per-head weights (the model folds H^-0.5 into them).
        scale: the D^-0.5 factor inside the ReLU.
    Returns:
        [B, T, S] float32 (float64 if an input is).
    The ReLU is taken per head, before the signed weight: ReLU of the weighted sum is a different
    (and wrong) function (docs/design.md §10, trap 2).
    """
    B, T, H, D = check_tensor("q", q, ndim=4, floating=True)
    check_tensor("k", k, shape=(B, None, D), floating=True)
    check_tensor("w", w, shape=(B, T, H), floating=True)
    acc = acc_dtype(q, k, w)
    logits = torch.einsum("bthd,bsd->bths", q.to(acc), k.to(acc)) * float(scale)
    return torch.einsum("bths,bth->bts", torch.relu(logits), w.to(acc))


@op(kernel="topk_triton", cpu="topk_cpu",
    fake=lambda scores, topk, q_pos: result_like(scores, (*scores.shape[:2], topk), torch.int32))
def topk_indices(scores: torch.Tensor, topk: int, q_pos: torch.Tensor) -> torch.Tensor:
    """Top-k key positions per query among the causal candidates 0..q_pos (itself included).

    Args:
        scores: [B, T, S] index scores (any float dtype; NaN is rejected).
        topk: keys to keep per query, >= 1.
        q_pos: [B, T] integer absolute position of each query.
    Returns:
        int32 [B, T, topk]: positions ordered by descending score, ties broken by the lower position;
        when fewer than ``topk`` candidates exist the row is padded with -1 at the end (never with a
        future position: docs/design.md §10, trap 3).
    A padding query (q_pos -1) has no candidate: its row is all -1. A NaN score is rejected when ``scores``
    is in CPU memory (elsewhere the check would cost a device sync per call; NaN then sorts first).
    """
    B, T, S = check_topk_args(scores, topk, q_pos)
    pos = torch.arange(S, device=scores.device)
    candidate = pos.view(1, 1, S) <= q_pos.to(torch.long).unsqueeze(-1)  # [B, T, S]
    # Non-candidates sort after every candidate: -inf ties with a candidate scored -inf, and a
    # stable sort then keeps the lower position (every candidate) first.
    masked = scores.masked_fill(~candidate, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices  # ties -> lower position
    k_eff = min(topk, S)
    idx = order[..., :k_eff]
    valid = torch.gather(candidate, -1, idx)
    idx = torch.where(valid, idx, torch.full_like(idx, -1)).to(torch.int32)
    if k_eff < topk:
        pad = torch.full((B, T, topk - k_eff), -1, dtype=torch.int32, device=scores.device)
        idx = torch.cat([idx, pad], dim=-1)
    return idx


@op(kernel="scores_triton", cpu="scores_cpu",
    fake=lambda q, w, key_plane, key_scale_plane, block_table, context_lens, scale, q_pos=None:
        result_like(q, (*q.shape[:2], block_table.shape[1] * key_plane.shape[1])))
def paged_index_scores(q: torch.Tensor, w: torch.Tensor, key_plane: torch.Tensor,
                           key_scale_plane: torch.Tensor | None, block_table: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, q_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Index scores of each query against every cached key of its own sequence (up to its own position).

    Args:
        q: [B, T, H, D] indexer queries; w: [B, T, H] signed head weights.
        key_plane: [num_blocks, block_size, D] cached indexer keys (float8_e4m3fn with fp8 numerics).
        key_scale_plane: [num_blocks, block_size, 1] fp32 per-key scales, or None for unquantised keys.
        block_table: int32 [B, max_blocks] physical block of each logical block (-1 = none).
        context_lens: int32 [B] keys each sequence holds (the new tokens included).
        scale: the D^-0.5 factor inside the ReLU.
        q_pos: int [B, T] each query's own position, or None. Given, a key after it scores -inf: top-k could
            never select it (``topk_indices``' causal bound), and a prefill kernel need not score it, about half
            of a long prompt's pairs. -1 (padding) masks the whole row.
    Returns:
        [B, T, S] float32 with S = max_blocks * block_size (a shape fixed by the table, not by the data):
        ``index_scores`` over positions < context_lens[b] (and <= q_pos[b, t]), -inf at every other position
        and at any position whose block is -1 (nothing there to select).
    """
    B, bs, MB = check_paged_scores_args(q, w, key_plane, key_scale_plane, block_table, context_lens, q_pos)
    positions, kv_slots, keys = paged_keys(key_plane, key_scale_plane, block_table, MB * bs, acc_dtype(q, w))
    return mask_paged_scores(index_scores_ref(q, keys, w, scale), positions, kv_slots, context_lens, q_pos)


def paged_keys(key_plane, key_scale_plane, block_table, S: int, dtype) -> tuple[torch.Tensor, ...]:
    """Each sequence's keys at positions 0..S-1 through its block table -> (positions int64 [B, S], kv_slots [B, S]
    (-1 where the block is -1), keys [B, S, D] in ``dtype``, scaled by their per-key scales if any)."""
    B, bs = block_table.shape[0], key_plane.shape[1]
    positions = torch.arange(S, device=key_plane.device).expand(B, S)
    kv_slots = paged_kv_slots(block_table, positions, bs)
    keys = gather_kv_slots(key_plane, kv_slots).to(dtype)
    if key_scale_plane is not None:
        keys = keys * gather_kv_slots(key_scale_plane, kv_slots).to(dtype)
    return positions, kv_slots, keys


def mask_paged_scores(scores, positions, kv_slots, context_lens, q_pos) -> torch.Tensor:
    """scores [B, T, S] -> -inf at every position past the sequence's context, without a block, or (q_pos
    given) after the query's own position."""
    keep = ((positions < context_lens.long().unsqueeze(1)) & (kv_slots >= 0)).unsqueeze(1)  # [B, 1, S]
    if q_pos is not None:
        keep = keep & (positions.unsqueeze(1) <= q_pos.long().unsqueeze(-1))  # [B, T, S]
    return torch.where(keep, scores, torch.full_like(scores, float("-inf")))


# The plain references by the names the kernels' fallbacks and the tests call them.
index_scores_ref = index_scores.reference
paged_index_scores_ref = paged_index_scores.reference
topk_indices_ref = topk_indices.reference
