"""Argument checks of ``sparse_attention``.

Shapes and dtypes are always checked; the indices' range only where reading them costs no device sync
(``on_host``).
"""

from __future__ import annotations

import torch

from .._checks import check_tensor, on_host


def check_sparse_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor):
    """-> (B, T, H, Dk, S, Hkv, K). Out-of-range indices are a ValueError when they are in CPU memory."""
    B, T, H, Dk = check_tensor("q", q, ndim=4, floating=True)
    _, S, Hkv, _ = check_tensor("k", k, shape=(B, None, None, Dk), floating=True)
    check_tensor("v", v, shape=(B, S, Hkv, None), floating=True)
    K = check_tensor("indices", indices, shape=(B, T, None), integer=True)[2]
    if Hkv not in (1, H):
        raise ValueError(f"k has {Hkv} heads; it must have 1 (shared latent) or {H} (one per query head)")
    if indices.numel() and on_host(indices):
        if int(indices.max()) >= S:
            raise ValueError(f"indices hold position {int(indices.max())} but k has only S={S} positions")
        if int(indices.min()) < -1:
            raise ValueError(f"indices hold {int(indices.min())}; only -1 may mark padding")
    return B, T, H, Dk, S, Hkv, K
