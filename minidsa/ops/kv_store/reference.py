"""Reference KV store: write each new token's row into its slot of a paged cache plane.

Slot -1 means "no write" (a padding token). On the CPU the slots are read directly (checked, and the
-1 rows dropped by a mask). On a device a boolean-mask write would need the mask on the host (a sync
per call); there every -1 row instead repeats the write of the first real row, which leaves the plane
exactly as a skipped row would, whatever order the writes land in.
"""

from __future__ import annotations

import torch

from .._checks import cast, check_tensor, on_host


def store_kv_ref(plane: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """In place: plane viewed as [num_blocks * block_size, W] gets ``values[i]`` at row ``slot_mapping[i]``.

    Args:
        plane: [num_blocks, block_size, W] one cache plane of one layer (any dtype, e.g. float8_e4m3fn).
        slot_mapping: integer [N] physical slots, -1 = skip this row. Real slots must be distinct.
        values: [N, W] rows to store, cast to plane.dtype.
    """
    _, _, W = check_tensor("plane", plane, ndim=3)
    N = check_tensor("slot_mapping", slot_mapping, ndim=1, integer=True)[0]
    check_tensor("values", values, shape=(N, W))
    if N == 0:
        return
    flat = plane.view(-1, W)
    slots = slot_mapping.long()
    valid = slots >= 0
    if on_host(slot_mapping, plane):  # reading the slots costs nothing here
        if int(slots.max()) >= flat.shape[0]:
            raise ValueError(f"slot_mapping holds slot {int(slots.max())}; the plane has {flat.shape[0]} slots")
        if not bool(valid.all()):
            slots, values = slots[valid], values[valid]
        flat[slots] = cast(values, flat.dtype)
        return
    # Padding rows repeat the first real row's write; with no real row at all, row 0 of the plane
    # is written back onto itself. Either way the plane ends as if they were skipped. (``first`` stays
    # a 1-element tensor: indexing with a 0-d tensor would read it on the host.)
    first = torch.argmax(valid.to(torch.int8)).view(1)  # first real row (row 0 when there is none)
    any_valid = valid.index_select(0, first)
    fallback_slot = torch.where(any_valid, slots.index_select(0, first), torch.zeros_like(first))
    fallback_row = torch.where(any_valid.unsqueeze(-1), values.index_select(0, first).to(flat.dtype), flat[:1])
    target = torch.where(valid, slots, fallback_slot)
    rows = torch.where(valid.unsqueeze(-1), values.to(flat.dtype), fallback_row)
    flat[target] = rows
