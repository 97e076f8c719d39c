"""Triton kernel for the paged KV store: the same contract as ``kv_store.store_kv_ref``.

Each new token's row of width W goes to row ``slot_mapping[i]`` of a cache plane viewed as
[num_blocks * block_size, W]; slot -1 means "no write".

Why a kernel is simple here, and the reference is not: the reference must avoid a boolean-mask write
(it would read the mask on the host), so it redirects padding rows onto a repeat of the first real
write. A kernel instead gives every token its own program, and a program whose slot is -1 returns
before touching memory. Writes of distinct slots never overlap, so programs need no ordering and the
result is deterministic.

Tiling: one program per (token, chunk of BLOCK_W columns). A row is contiguous in both ``values``
and the plane, so each program issues one coalesced masked load and one masked store; the column mask
handles widths that are not powers of two (a 576-wide latent row is 5 chunks of 128, the last one
half used). The cast to the plane's dtype (e.g. float8_e4m3fn) happens in registers, on the way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_tensor


@triton.jit
def _store_rows(plane_ptr, slots_ptr, values_ptr, W, values_stride, BLOCK_W: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    slot = tl.load(slots_ptr + row).to(tl.int64)  # int64: slot * W can pass 2^31 in a large cache
    if slot >= 0:
        mask = cols < W
        v = tl.load(values_ptr + row * values_stride + cols, mask=mask)
        tl.store(plane_ptr + slot * W + cols, v.to(plane_ptr.dtype.element_ty), mask=mask)


def store_kv(plane: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """In place: plane [num_blocks, block_size, W] gets ``values[i]`` [N, W] at row ``slot_mapping[i]``
    (integer [N], -1 = skip). Real slots must be distinct (as the reference requires)."""
    _, _, W = check_tensor("plane", plane, ndim=3)
    N = check_tensor("slot_mapping", slot_mapping, ndim=1, integer=True)[0]
    check_tensor("values", values, shape=(N, W))
    if N == 0:
        return
    if not plane.is_contiguous():
        raise ValueError("plane must be contiguous (a cache plane is one [num_blocks, block_size, W] tensor)")
    if values.stride(-1) != 1:
        values = values.contiguous()
    BLOCK_W = min(triton.next_power_of_2(W), 256)
    _store_rows[(N, triton.cdiv(W, BLOCK_W))](plane, slot_mapping, values, W, values.stride(0), BLOCK_W=BLOCK_W)
