"""Reference KV store: write each new token's row into its slot of a paged cache plane.

Slot -1 means "no write" (a padding token). A boolean-mask write would need the mask on the host (a device
sync per call), so every -1 row instead repeats the write of the first real row: the plane ends exactly as if
the row were skipped, whatever order the writes land in.
"""

from __future__ import annotations

import torch

from .._checks import cast
from .._dispatch import op
from .checks import check_store_args


@op(kernel="store_triton", mutates=("plane",), fake=lambda plane, kv_slots, values: None)
def store_kv(plane: torch.Tensor, kv_slots: torch.Tensor, values: torch.Tensor) -> None:
    """In place: plane viewed as [num_blocks * block_size, W] gets ``values[i]`` at row ``kv_slots[i]``.

    Args:
        plane: [num_blocks, block_size, W] one cache plane of one layer (any dtype, e.g. float8_e4m3fn).
        kv_slots: integer [N] physical KV slots, -1 = skip this row. Real slots must be distinct.
        values: [N, W] rows to store, cast to plane.dtype.
    """
    N, W = check_store_args(plane, kv_slots, values)
    if N == 0:
        return
    flat = plane.view(-1, W)
    kv_slots = kv_slots.long()
    valid = kv_slots >= 0
    # With no real row at all, row 0 of the plane is written back onto itself. (``first`` stays a
    # 1-element tensor: indexing with a 0-d tensor would read it on the host.)
    first = torch.argmax(valid.to(torch.int8)).view(1)  # first real row (row 0 when there is none)
    any_valid = valid.index_select(0, first)
    fallback_slot = torch.where(any_valid, kv_slots.index_select(0, first), torch.zeros_like(first))
    fallback_row = torch.where(any_valid.unsqueeze(-1), cast(values.index_select(0, first), flat.dtype), flat[:1])
    target = torch.where(valid, kv_slots, fallback_slot)
    rows = torch.where(valid.unsqueeze(-1), cast(values, flat.dtype), fallback_row)
    flat[target] = rows


# The plain references by the names the kernels' fallbacks and the tests call them.
store_kv_ref = store_kv.reference
