"""Reading the paged cache the way a kernel does: block table -> physical slot -> row.

A cache plane is one tensor [num_blocks, block_size, width]; token ``pos`` of batch row ``b`` lives at
``slot = block_table[b, pos // block_size] * block_size + pos % block_size``, i.e. row ``slot`` of the
plane viewed as [num_blocks * block_size, width]. Index -1 (top-k padding) and table entries of -1
(no block) give slot -1, which is never read: the gather reads a clamped, valid row and discards it
with a select, exactly what a kernel's masked load does, so garbage or NaN in unselected memory can
never reach the output (docs/design.md §3, §10 trap 4). Nothing here needs the indices on the host.
"""

from __future__ import annotations

import torch


def paged_kv_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """block_table int [B, max_blocks] (-1 = no block), positions int [B, N] (-1 = padding)
    -> physical slots int64 [B, N], -1 wherever the position is padding or has no block. With ``rows``
    (int [N]: the table row of each position), positions is flat [N] and so is the result: the tokens of
    several rows of different lengths, as a packed step lays them out."""
    pos = positions.long()
    block = pos.clamp_min(0) // block_size
    in_table = block < block_table.shape[1]
    clamped = block.clamp_max(block_table.shape[1] - 1)
    table = block_table.long()
    physical = table.gather(1, clamped) if rows is None else table[rows, clamped]
    valid = (pos >= 0) & in_table & (physical >= 0)
    return torch.where(valid, physical * block_size + pos.clamp_min(0) % block_size, torch.full_like(pos, -1))


def gather_kv_slots(plane: torch.Tensor, kv_slots: torch.Tensor) -> torch.Tensor:
    """plane [num_blocks, block_size, W], kv_slots int [B, N] (-1 = none) -> rows [B, N, W] in plane.dtype,
    zeros where the slot is -1 (that memory is selected away, never used)."""
    flat = plane.reshape(-1, plane.shape[-1])
    rows = flat[kv_slots.clamp_min(0)]
    return torch.where((kv_slots >= 0).unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def gather_positions(plane: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of logical ``positions`` [B, N] (-1 = padding) of each batch row's sequence -> [B, N, W]."""
    return gather_kv_slots(plane, paged_kv_slots(block_table, positions, plane.shape[1]))
