"""The union build of the sparse MLA prefill's union form (prefill_triton.py): per tile of BLOCK_M queries, the
sorted union of the positions its queries selected, and each query's selection as bits over that union.

Three kernels, all over int32 words of 32 bits, each with a host launcher:

1. ``_mark_bits`` (``bitmaps``; one program per query) sets one bit per valid selected pos (not -1, below S,
   inside the block table, its block not -1: the reference's padding rule) in the query's bit row, [B * T,
   ceil(S / 32)] int32, with an atomic OR, and counts the valid selections. What binds it: selections within
   32 positions of each other share a word, and their atomics queue on it.
2. ``_tile_union`` (``tile_unions``; one program per tile) ORs its queries' rows word by word and unpacks the
   set bits, in order, into the sorted union list [B, n_tiles, S] and its count; it also sums, over the tiles,
   the (query, union slot) pairs, the valid selected pairs and the mask words: the counts the form choice
   (prefill_form.py) and the mask's allocation need, read by the host in one copy.
3. ``_mask_row`` (``tile_masks``; one program per query) writes the query's column of its tile's mask:
   [ceil(count / 32), BLOCK_M] int32 per tile, bit j of word (c, m) = query m's bit for position
   union[c * 32 + j]. It reads the union list in order and looks bits up in its own bit row (4 bytes per 32
   positions, cached). Chunk-major, so that the attention loop reads a chunk's BLOCK_M words as one
   contiguous run; zeros past count and past T let it load every chunk without bounds.

Why bits: each selection is one atomic OR into its query's row, and the unions and masks are built from rows
read in order. A byte per selected pair stored twice at scattered addresses (a byte per (tile, position) whose
cumulative sum ranks the union, then a byte per mask entry through that rank) costs several times more, and
sorting each query's picks first to make those stores contiguous costs more than it saves.

Memory: the bit rows take T x S / 8 bytes (128 MB at T = S = 32k, 2 GB at 128k), freed before the attention;
a longer prefill would have to build them per range of tiles. The mask takes BLOCK_M / 8 bytes per union
slot: 18 MB at T = 32k when a tile's union is 2.3x top-k, 67 MB when it is the whole prefix.

Compiled variants: Triton specialises integer arguments on divisibility by 16 (and on 1). The lengths (T, S,
the union's row length, the tile count) are left unspecialised, and so are the strides that only scale them,
so that prompt lengths share compiled variants; the batch strides, which set the alignment of the row loads,
are not. ``_tile_union``'s block width is fixed, not derived from the row width, for the same reason.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _selected(idx_ptr, table_ptr, b, t, k0, T, K, S, max_blocks, s_ib, s_it, s_tb, BS: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """Entries k0 .. k0+BLOCK_K of query (b, t) -> (pos [BLOCK_K], valid [BLOCK_K]). A position is valid
    when it is not padding (-1), lies below S and inside the block table, and its block entry is not -1
    (the reference's padding rule; an invalid position's table entry is never read)."""
    k = k0 + tl.arange(0, BLOCK_K)
    pos = tl.load(idx_ptr + b * s_ib + t * s_it + k, mask=k < K, other=-1)
    blk = tl.where(pos >= 0, pos, 0) // BS
    valid = (pos >= 0) & (pos < S) & (blk < max_blocks)
    entry = tl.load(table_ptr + b * s_tb + blk, mask=valid, other=-1)
    return pos, valid & (entry >= 0)


@triton.jit(do_not_specialize=["T", "S", "W", "max_blocks", "s_ib", "s_tb"])
def _mark_bits(idx_ptr, table_ptr, bits_ptr, n_valid_ptr, T, K, S, W, max_blocks, s_ib, s_it, s_tb,
               BS: tl.constexpr, BLOCK_K: tl.constexpr):
    """One query (b, t): bit pos % 32 of bits[b * T + t, pos // 32] for each valid selected pos, and the
    number of valid selections in n_valid[b * T + t]. An atomic OR per selection (relaxed: only the final
    words are read, by later launches); OR is order-free, so the words do not depend on the order the
    atomics land in. Selections within 32 positions of each other share a word and their atomics queue on
    it (late queries at T = 32k put two selections in a word on average)."""
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // T, bt % T
    row = bits_ptr + bt * W
    n_valid = 0
    for k0 in range(0, K, BLOCK_K):
        pos, valid = _selected(idx_ptr, table_ptr, b, t, k0, T, K, S, max_blocks, s_ib, s_it, s_tb, BS, BLOCK_K)
        one = tl.full([BLOCK_K], 1, tl.int32) << (pos & 31)
        tl.atomic_or(row + (pos >> 5), one, mask=valid, sem="relaxed")
        n_valid += tl.sum(valid.to(tl.int32), 0)
    tl.store(n_valid_ptr + bt, n_valid)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit(do_not_specialize=["T", "L", "n_tiles"])
def _tile_union(bits_ptr, n_valid_ptr, union_ptr, count_ptr, words_ptr, stats_ptr, T, W, L, n_tiles,
                BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """One tile (b, tile): the OR of its queries' bit rows, unpacked into the sorted list of positions
    union[b, tile, :count] and its count; the size of its mask in words[b * n_tiles + tile] (BLOCK_M words
    per 32 union slots); and, added into stats int64 [3], the (query, union slot) pairs it attends, its
    queries' valid selections and its mask words. A running rank carries the list across word chunks."""
    bi = tl.program_id(0).to(tl.int64)
    b, tile = bi // n_tiles, bi % n_tiles
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ptr = bits_ptr + (b * T + rows.to(tl.int64))[:, None] * W
    total = 0
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        words = tl.load(row_ptr + w[None, :], mask=(rows < T)[:, None] & (w < W)[None, :], other=0)
        chosen = tl.reduce(words, 0, _or)  # [BLOCK_W]
        flag = ((chosen[:, None] >> tl.arange(0, 32)[None, :]) & 1).reshape(BLOCK_W * 32)  # bit j = pos w*32+j
        rank = total + tl.cumsum(flag, 0) - flag
        tl.store(union_ptr + bi * L + rank, w0 * 32 + tl.arange(0, BLOCK_W * 32), mask=flag != 0)
        total += tl.sum(flag, 0)
    tl.store(count_ptr + bi, total)
    mask_words = ((total + 31) // 32 * BLOCK_M).to(tl.int64)
    tl.store(words_ptr + bi, mask_words)
    # Integer atomics are order-free: the sums do not depend on the order the tiles finish in.
    selected = tl.sum(tl.load(n_valid_ptr + b * T + rows, mask=rows < T, other=0), 0)
    tl.atomic_add(stats_ptr, total.to(tl.int64) * tl.minimum(T - tile * BLOCK_M, BLOCK_M), sem="relaxed")
    tl.atomic_add(stats_ptr + 1, selected.to(tl.int64), sem="relaxed")
    tl.atomic_add(stats_ptr + 2, mask_words, sem="relaxed")


@triton.jit(do_not_specialize=["T", "W", "L", "n_tiles"])
def _mask_row(bits_ptr, union_ptr, count_ptr, mask_ptr, mask_off_ptr, T, W, L, n_tiles, BLOCK_M: tl.constexpr,
              BLOCK_R: tl.constexpr):
    """One query row (b, tile * BLOCK_M + m) of its tile's mask [ceil(count / 32), BLOCK_M] int32 at
    mask_off[tile]: bit j of word (c, m) = the query's bit for position union[c * 32 + j] (0 past count;
    rows past T are all zeros). Chunk-major, so that the attention loop reads a chunk's BLOCK_M words
    contiguously. One query per program keeps the bit lookups inside one row of 4 bytes per 32 positions
    (cached); its stores are BLOCK_M words apart."""
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // (n_tiles * BLOCK_M), bt % (n_tiles * BLOCK_M)
    bi = b * n_tiles + t // BLOCK_M
    count = tl.load(count_ptr + bi)
    live_slots = tl.where(t < T, count, 0)
    out = mask_ptr + tl.load(mask_off_ptr + bi) + t % BLOCK_M
    row = bits_ptr + (b * T + t) * W
    for r0 in range(0, count, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        live = r < live_slots
        pos = tl.load(union_ptr + bi * L + r, mask=live, other=0)
        bit = (tl.load(row + (pos >> 5), mask=live, other=0) >> (pos & 31)) & 1
        # Distinct bits: their sum is their OR (bit 31 wraps to the sign bit, as intended).
        word = tl.sum(bit.reshape(BLOCK_R // 32, 32) << tl.arange(0, 32)[None, :], axis=1)
        c = r0 // 32 + tl.arange(0, BLOCK_R // 32)
        tl.store(out + c * BLOCK_M, word, mask=c * 32 < count)


def bitmaps(idx, table, bs: int, B: int, T: int, S: int, on_gpu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(bits int32 [B * T, ceil(S / 32)], n_valid int32 [B * T]): bit p % 32 of word p // 32 of row b * T + t
    is set when query (b, t) selected the valid position p; n_valid counts its valid selections. 4 bytes
    per query and 32 positions: 128 MB at T = S = 32k."""
    K = idx.shape[-1]
    bits = torch.zeros(B * T, triton.cdiv(S, 32), dtype=torch.int32, device=idx.device)
    n_valid = torch.empty(B * T, dtype=torch.int32, device=idx.device)
    # 128 selections per step and 1 warp: the fastest of the widths tried on the H200 (the atomics bind it).
    block_k = min(128 if on_gpu else 64, triton.next_power_of_2(K))
    _mark_bits[(B * T,)](idx, table, bits, n_valid, T, K, S, bits.shape[1], table.shape[1], idx.stride(0),
                         idx.stride(1), table.stride(0), BS=bs, BLOCK_K=block_k, num_warps=1)
    return bits, n_valid


def tile_unions(bits, n_valid, B: int, T: int, S: int, BLOCK_M: int, on_gpu: bool):
    """Per tile of BLOCK_M queries, the sorted union of the positions its queries selected -> (union int32
    [B, n_tiles, S], the first count[b, tile] entries being the positions; count int32 [B, n_tiles];
    mask_off int64 [B * n_tiles], where each tile's mask starts, the tiles back to back; stats int64 [3]:
    the (query, union slot) pairs, the valid selected pairs and the mask words, summed over the tiles)."""
    n_tiles, W = triton.cdiv(T, BLOCK_M), bits.shape[1]
    union = torch.empty(B * n_tiles, S, dtype=torch.int32, device=bits.device)
    count = torch.empty(B * n_tiles, dtype=torch.int32, device=bits.device)
    words = torch.empty(B * n_tiles, dtype=torch.int64, device=bits.device)
    stats = torch.zeros(3, dtype=torch.int64, device=bits.device)
    block_w = 64 if on_gpu else 4  # fixed, not per W: one compiled variant for every prompt length
    _tile_union[(B * n_tiles,)](bits, n_valid, union, count, words, stats, T, W, S, n_tiles, BLOCK_M=BLOCK_M,
                                BLOCK_W=block_w, num_warps=8 if on_gpu else 1)
    return union.view(B, n_tiles, S), count.view(B, n_tiles), torch.cumsum(words, 0) - words, stats


def tile_masks(bits, union, count, mask_off, total: int, T: int, BLOCK_M: int, on_gpu: bool) -> torch.Tensor:
    """Each query's selection as bits over its tile's union: int32 [total]. Tile i is [ceil(count[i] / 32),
    BLOCK_M] at mask_off[i]; bit j of word (c, m) is set where query m of the tile selected union slot c *
    32 + j. Zeros past count and past T let the attention loop load every chunk without bounds."""
    B, n_tiles, L = union.shape
    mask = torch.empty(max(1, total), dtype=torch.int32, device=bits.device)  # every word is written
    _mask_row[(B * n_tiles * BLOCK_M,)](bits, union, count, mask, mask_off, T, bits.shape[1], L, n_tiles,
                                       BLOCK_M=BLOCK_M, BLOCK_R=1024 if on_gpu else 64, num_warps=4 if on_gpu else 1)
    return mask
