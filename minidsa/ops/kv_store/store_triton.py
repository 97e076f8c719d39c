"""Triton kernel of the paged KV store, ``store_kv``: the contract of ``store_kv_ref`` in
``minidsa/ops/kv_store/reference.py``.

Each new token's row of width W goes to row ``kv_slots[i]`` of a cache plane viewed as
[num_blocks * block_size, W]; slot -1 means "no write".

Why a kernel is simple here, and the reference is not: the reference must avoid a boolean-mask write
(it would read the mask on the host), so it redirects padding rows onto a repeat of the first real
write. A kernel instead masks every row by its own slot: a row whose slot is -1 is neither read
nor written. Writes of distinct slots never overlap, so programs need no ordering and the
result is deterministic.

Tiling: one program per tile of BLOCK_N tokens x BLOCK_W columns. Rows are contiguous in both
``values`` and the plane, so a tile is BLOCK_N coalesced row segments; a program moves about 16 KB,
enough bytes in flight per SM to approach HBM bandwidth at prefill sizes (a single 1 KB row per
program keeps too few in flight). The row mask (slot -1, or past N) and the column mask (widths
that are not powers of two: 576 = kv_lora 512 + rope 64) make skipped rows and padding columns
touch nothing. The cast to the plane's dtype (e.g. float8_e4m3fn) happens in registers, on the way.

Binds: HBM bandwidth when many bytes move (a prefill of 576-wide bf16 rows); the launch and the tail
when few do (a decode step; narrow fp8 rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_store_args


# The row count and the slots' address (a slice of the step's metadata) vary from step to step: not specialised
# on, so a new step compiles no new variant.
@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["kv_slots_ptr"])
def _store_rows(plane_ptr, kv_slots_ptr, values_ptr, N, W, values_stride,
                BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    kv_slots = tl.load(kv_slots_ptr + rows, mask=rows < N, other=-1).to(tl.int64)  # int64: slot * W can pass 2^31
    mask = (kv_slots >= 0)[:, None] & (cols < W)[None, :]
    v = tl.load(values_ptr + rows.to(tl.int64)[:, None] * values_stride + cols[None, :], mask=mask)
    tl.store(plane_ptr + kv_slots[:, None] * W + cols[None, :], v.to(plane_ptr.dtype.element_ty), mask=mask)


def store_kv(plane: torch.Tensor, kv_slots: torch.Tensor, values: torch.Tensor) -> None:
    """In place: plane [num_blocks, block_size, W] gets ``values[i]`` [N, W] at row ``kv_slots[i]``
    (integer [N], -1 = skip). Real slots must be distinct (as the reference requires)."""
    N, W = check_store_args(plane, kv_slots, values)
    if N == 0:
        return
    if not plane.is_contiguous():
        raise ValueError("plane must be contiguous (a cache plane is one [num_blocks, block_size, W] tensor)")
    if values.stride(-1) != 1:
        values = values.contiguous()
    BLOCK_W = min(triton.next_power_of_2(W), 1024)
    # 16 KB of rows per program, whatever N is: a tile that followed N (its next power of two) would compile a
    # variant per batch size and prompt length (N itself is left unspecialised for the same reason).
    BLOCK_N = max(1, 16384 // (BLOCK_W * values.element_size()))
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(W, BLOCK_W))
    _store_rows[grid](plane, kv_slots, values, N, W, values.stride(0), BLOCK_N=BLOCK_N, BLOCK_W=BLOCK_W)
