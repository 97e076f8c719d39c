"""Argument checks of the indexer ops, shared by the references, the CPU form and the kernels.

Shapes and dtypes are always checked; values (NaN scores) only where reading them costs no device sync
(``on_host``).
"""

from __future__ import annotations

import torch

from .._checks import check_tensor, on_host


def check_topk_args(scores, topk, q_pos) -> tuple[int, int, int]:
    """Argument checks of ``topk_indices`` -> (B, T, S); NaN scores are rejected when they are in CPU memory
    (elsewhere the check would cost a device sync per call, and NaN then sorts first)."""
    B, T, S = check_tensor("scores", scores, ndim=3, floating=True)
    check_tensor("q_pos", q_pos, shape=(B, T), integer=True)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if on_host(scores) and bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN; top-k of NaN is undefined (check the indexer inputs)")
    return B, T, S


def check_paged_scores_args(q, w, key_plane, key_scale_plane, block_table, context_lens,
                            q_pos=None) -> tuple[int, int, int]:
    """Argument checks of ``paged_index_scores`` -> (B, block_size, max_blocks)."""
    B, T, H, D = check_tensor("q", q, ndim=4, floating=True)
    check_tensor("w", w, shape=(B, T, H), floating=True)
    _, bs, _ = check_tensor("key_plane", key_plane, shape=(None, None, D))
    MB = check_tensor("block_table", block_table, shape=(B, None), integer=True)[1]
    check_tensor("context_lens", context_lens, shape=(B,), integer=True)
    if key_scale_plane is not None:
        check_tensor("key_scale_plane", key_scale_plane, shape=(key_plane.shape[0], bs, 1))
    if q_pos is not None:
        check_tensor("q_pos", q_pos, shape=(B, T), integer=True)
    return B, bs, MB
