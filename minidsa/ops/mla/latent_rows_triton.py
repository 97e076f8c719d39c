"""The row-number pass of the sparse MLA latent attention (latent_triton.py, latent_gluon.py): the selected
positions of every query turned into plane row numbers, once per call, before the attention kernel runs.

    rows[b, t, k] = block_table[b, idx // bs] * bs + idx % bs     for a valid position, else -1

A position is valid only if idx >= 0, idx // bs is inside the table and the table entry is >= 0 (the table
entry of an invalid position is never read). The same buffer holds, after the row numbers, a row of zeros
that the attention loops read in place of an invalid row: their gathered loads then need no mask, and an
unselected plane row that holds a NaN cannot reach the output (docs/design.md §10 trap 4).

Why a pass of its own: the attention loop then reads one int32 per gathered row. Converting the indices in
the loop costs every thread that gathers a row the division, the table load and the multiply, once per plane
layout and tile, in a loop bound by its instructions' latency rather than by memory. The cache block size BS is
a compile-time constant: // and % by a runtime int cost about 20 integer instructions per row.

Plane layout (``row_plane``): rows of consecutive cache blocks are consecutive in every plane the cache
allocates, so one row number times the row stride addresses a plane; other layouts are copied first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Table width and T unspecialised (T = 1 keeps its variant): no new variant per prompt length.
@triton.jit(do_not_specialize=["max_blocks", "s_tb"], do_not_specialize_on_alignment=["T"])
def _row_numbers(idx_ptr, table_ptr, rows_ptr, zero_ptr, T, K, max_blocks, s_tb, s_ib, s_it,
                 BS: tl.constexpr, BLOCK: tl.constexpr, ZERO_WORDS: tl.constexpr):
    """Selected positions -> plane row numbers: rows[bt, k] = table[b, idx // BS] * BS + idx % BS, or -1 where
    the position is padding (-1), past the block table, or in a block whose entry is -1 (neither that entry nor
    any plane row is read). Program (0, 0) also zero-fills the zero row (ZERO_WORDS int32 words)."""
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // T, bt % T
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = n < K
    idx = tl.load(idx_ptr + b * s_ib + t * s_it + n, mask=inside, other=-1)
    pos = tl.where(idx >= 0, idx, 0).to(tl.uint32)
    blk = (pos // BS).to(tl.int32)
    valid = (idx >= 0) & (blk < max_blocks)
    phys = tl.load(table_ptr + b * s_tb + blk, mask=valid, other=-1)
    valid = valid & (phys >= 0)
    rows = tl.where(valid, phys * BS + (pos % BS).to(tl.int32), -1)
    tl.store(rows_ptr + bt * K + n, rows, mask=inside)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(zero_ptr + tl.arange(0, ZERO_WORDS), tl.zeros([ZERO_WORDS], tl.int32))


def row_plane(plane: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A cache plane [blocks, bs, W] and its row stride, such that row ``phys * bs + off`` sits at element
    row * stride: true for every plane the cache allocates (blocks back to back), and for column views of
    one. Other layouts, a last dim with a stride included, are copied (the model never builds them)."""
    n, bs, _ = plane.shape
    if plane.stride(-1) != 1 or (bs > 1 and n > 1 and plane.stride(0) != bs * plane.stride(1)):
        plane = plane.contiguous()
    return plane, plane.stride(1) if bs > 1 else plane.stride(0)


def rows_and_zero_row(block_table, indices, B: int, T: int, K: int, bs: int, zero_bytes: int, on_gpu: bool):
    """Launch _row_numbers: (rows int32 [B*T*K] as a flat buffer, zero row of zero_bytes bytes as int32 words
    in the same buffer, 16-byte aligned)."""
    start = triton.cdiv(B * T * K, 4) * 4
    words = triton.next_power_of_2(max(4, zero_bytes // 4))
    buf = torch.empty(start + words, dtype=torch.int32, device=indices.device)
    block = min(1024 if on_gpu else 64, triton.next_power_of_2(K))
    _row_numbers[(B * T, triton.cdiv(K, block))](indices, block_table, buf, buf[start:], T, K, block_table.shape[1],
                                                 block_table.stride(0), indices.stride(0), indices.stride(1),
                                                 BS=bs, BLOCK=block, ZERO_WORDS=words)
    return buf, buf[start:]
