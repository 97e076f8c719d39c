"""Argument checks of ``store_kv``, shared by the reference and the kernel.

Shapes and dtypes are always checked; the slots' range only where reading them costs no device sync
(``on_host``).
"""

from __future__ import annotations

import torch

from .._checks import check_tensor, on_host


def check_store_args(plane: torch.Tensor, kv_slots: torch.Tensor, values: torch.Tensor) -> tuple[int, int]:
    """-> (N, W). A slot past the plane, or below -1, is a ValueError when the slots are in CPU memory."""
    _, _, W = check_tensor("plane", plane, ndim=3)
    N = check_tensor("kv_slots", kv_slots, ndim=1, integer=True)[0]
    check_tensor("values", values, shape=(N, W))
    if N and on_host(kv_slots):
        rows = plane.shape[0] * plane.shape[1]
        if int(kv_slots.max()) >= rows or int(kv_slots.min()) < -1:
            bad = int(kv_slots.max()) if int(kv_slots.max()) >= rows else int(kv_slots.min())
            raise ValueError(f"kv_slots holds slot {bad}; the plane has {rows} slots (0..{rows - 1}; -1 skips a row)")
    return N, W
