"""The paged index scores in a fast CPU form: same signature and result as ``paged_index_scores_ref``.

A padded batch of prompts scores only the pairs that can survive, row by row: the queries up to a row's last
real one against the keys up to its largest position (the causal bound makes every later key -inf, about half
of a long prompt's pairs). Reading ``q_pos`` for those bounds is free in CPU memory. A decode step (one query
a row) takes the reference's one product: there a row's loop costs more than the keys it skips.
"""

from __future__ import annotations

import torch

from .._checks import acc_dtype
from .checks import check_paged_scores_args
from .reference import index_scores_ref, mask_paged_scores, paged_keys


def live_extent(q_pos: torch.Tensor) -> list[tuple[int, int]]:
    """Per row of q_pos [B, T] (CPU): (queries up to the last real one, keys up to its largest position + 1)."""
    real = q_pos >= 0
    last = torch.where(real, torch.arange(1, q_pos.shape[1] + 1), 0).amax(1)
    return list(zip(last.tolist(), (q_pos.amax(1).clamp_min(-1) + 1).tolist()))


def paged_index_scores(q, w, key_plane, key_scale_plane, block_table, context_lens, scale, q_pos=None):
    """``paged_index_scores_ref`` (see there for shapes), skipping the pairs past each row's causal bound."""
    B, bs, MB = check_paged_scores_args(q, w, key_plane, key_scale_plane, block_table, context_lens, q_pos)
    positions, kv_slots, keys = paged_keys(key_plane, key_scale_plane, block_table, MB * bs, acc_dtype(q, w))
    if q_pos is None or not q_pos.numel() or q_pos.shape[1] == 1:
        scores = index_scores_ref(q, keys, w, scale)
    else:
        scores = q.new_zeros((B, q.shape[1], MB * bs), dtype=keys.dtype)  # the pairs left out are masked below
        for b, (n, hi) in enumerate(live_extent(q_pos.cpu())):
            scores[b, :n, :hi] = index_scores_ref(q[b:b + 1, :n], keys[b:b + 1, :hi], w[b:b + 1, :n], scale)[0]
    return mask_paged_scores(scores, positions, kv_slots, context_lens, q_pos)
