"""Triton kernels of the indexer's causal top-k: an exact radix select spread over many programs per
row, then a sort of the selected keys only. Same signature and result as ``topk_indices_ref`` in
``minidsa/ops/indexer/reference.py`` (docs/design.md §2, §12): int32 [B, T, topk], positions by
descending score, equal scores to the lower position, -1 padding after the candidates.

**Keys.** Each fp32 score becomes a uint32 ``u`` whose unsigned order is the float order (positive
floats keep their bits with the top bit set; negative ones have all bits flipped; -0.0 is read as
+0.0, since the two are equal scores and only the position may decide between them). Only the
*candidates* of a query, positions ``0 .. q_pos`` inside the row, take part; with ``n = min(topk,
candidates)`` the answer is the ``n`` best (u, position) pairs: the larger u wins and, for equal u,
the lower position.

**Select: four histogram passes over 8-bit digits of u**, high digit first. Pass ``L`` histograms
digit ``L`` of the candidates whose higher digits equal the prefix found so far. A pass is a grid
``(row, tile)`` of programs, each over ``BLOCK`` contiguous positions of one row, so a decode step
(32 rows x 65,536 keys) runs 512 programs instead of one per row (one program per row would stream
each pass through a single SM). Each program builds its tile's
histogram on chip (``tl.histogram``) and adds the non-empty bins to the row's histogram in global
memory with integer atomics, whose sum does not depend on their order: the histograms, and all that
follows, are bitwise reproducible. The next pass first finds (every program redoes this 256-bin
step; tile 0's program stores it) the one bin ``d`` where the keys above ``d`` are fewer than the keys
still needed and, with bin ``d``'s own, reach it; ``d`` joins the prefix, and the keys above it are
taken off the need. When bin ``d`` is taken whole the row is *resolved* (with distinct scores that
is usual after three digits): later passes skip its histogram and the threshold stays at the bin's
lowest key value. 256 bins per pass because ``tl.histogram`` costs grow with the bins: four passes
of 256 bins are faster than three of 2,048.

**Compact.** With the threshold ``thr`` exact, a counting pass records, per tile, the candidates above
``thr`` and those equal to it; the compacting pass turns them into offsets (a sum over the row's
earlier tiles plus a running sum inside the tile) and writes each selected key to its own slot: the
keys above ``thr``, then the ``need`` lowest positions equal to it. Each slot has one writer.

**Short rows** (at most ``_ROW_SORT_MAX_S`` = 2,048 positions, the size of the order step's sort
below, on the same ``tl.sort`` of int64 keys) skip the select: one program per row sorts all its
packed keys and keeps the first ``n``, one launch instead of eight; small models, whose decode steps
are bound by launches, have such rows.

**Order.** Only the ``n`` selected keys are sorted, packed as one int64 each, ``(u << 31) | (2^31 - 1 -
position)`` (a larger packed key is the better key), by ``tl.sort`` in one program per row; slots from
``n`` on get -1. The sort is cheaper than ranking every key against every other (``n^2``
comparisons over many programs per row), at decode and at prefill.

Binds: in a CUDA graph, the four histogram passes (the largest share of the GPU time; then the sort,
the compaction and the count); outside a graph, the host cost (Python and the driver) of the seven
launches.

fp64 scores (exactness tests only) and rows past 2^31 positions go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_topk_args
from .reference import topk_indices_ref

_DIGIT_BITS = 8  # four passes of 256 bins (see the docstring for why not 2,048)
_PASSES = 4
_NB = 2 ** _DIGIT_BITS
_STATE = 3  # per row and pass: prefix, keys still needed from the prefix's bin, resolved flag
_BLOCK, _WARPS = 4096, 8  # positions and warps of a select program on the GPU (an H200 sweep: flat at 1-8K)
_SORT_WARPS = 16  # 2,048 int64 keys: 16 warps sort them faster than 4 or 8
# Rows of at most this many positions are sorted whole, one program per row, in a single launch (the
# sort step's own size): the select's seven launches would cost more than they save on such rows.
_ROW_SORT_MAX_S = 2048


@triton.jit
def _keys(scores_ptr, qpos_ptr, row, pos, T, S, ss_b, ss_t, ss_s, sp_b, sp_t):
    """(u uint32, candidate bool) of positions ``pos`` of one query row (``row = b * T + t``)."""
    b = row // T
    t = row % T
    inside = pos < S
    x = tl.load(scores_ptr + b * ss_b + t * ss_t + pos * ss_s, mask=inside, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0: equal scores get one key, so the position decides
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # float order as signed-int order
    u = (ordered ^ -2147483648).to(tl.uint32, bitcast=True)  # ... and as unsigned order
    q_pos = tl.load(qpos_ptr + b * sp_b + t * sp_t)
    return u, inside & (pos <= q_pos)


@triton.jit
def _pack(u, pos):
    """One int64 per key, (u << 31) | (2^31 - 1 - position): a larger packed key is the better key
    (larger u; for equal u, the lower position). Every packed key is >= 0, so -1 sorts below all."""
    return (u.to(tl.int64) << 31) | (2147483647 - pos).to(tl.int64)


@triton.jit
def _sorted_positions(keys, i, n):
    """Packed keys [N] -> their positions in descending key order (int32), -1 from slot n on
    (i = arange(N), the slots)."""
    keys = tl.sort(keys, descending=True)
    return tl.where(i < n, 2147483647 - (keys & 2147483647), -1).to(tl.int32)


@triton.jit
def _first_need(qpos_ptr, row, T, S, topk, sp_b, sp_t):
    """n = min(topk, number of candidates 0..q_pos inside the row)."""
    q_pos = tl.load(qpos_ptr + (row // T) * sp_b + (row % T) * sp_t).to(tl.int64)
    return tl.minimum(tl.minimum(tl.maximum(q_pos + 1, 0), S), topk).to(tl.int32)


@triton.jit
def _find_digit(hist_ptr, need, NB: tl.constexpr):
    """The bin d that holds the need-th largest key -> (d, keys needed from bin d, keys in bin d).

    need <= 0 (nothing to select) gives d = NB - 1 and an empty take."""
    bins = tl.arange(0, NB)
    h = tl.load(hist_ptr + bins)
    above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # keys in the bins above each bin
    hit = (above < need) & (above + h >= need)
    d = tl.max(tl.where(hit, bins, -1), axis=0)
    left = need - tl.sum(tl.where(hit, above, 0), axis=0)
    return tl.where(d < 0, NB - 1, d), left, tl.sum(tl.where(hit, h, 0), axis=0)


@triton.jit
def _threshold(hist_row_ptr, state_ptr, qpos_ptr, row, T, S, topk, sp_b, sp_t, LEVEL: tl.constexpr,
               NB: tl.constexpr, BITS: tl.constexpr, PASSES: tl.constexpr):
    """(prefix uint32, need, resolved) after passes 0 .. LEVEL-1: pass LEVEL-1's digit found in its
    histogram, on top of the state of the pass before; the program of tile 0 stores it in
    state[row, LEVEL - 1] for the passes after. A resolved row keeps its state unchanged."""
    state_row = state_ptr + row.to(tl.int64) * (3 * PASSES)
    if LEVEL == 1:
        need = _first_need(qpos_ptr, row, T, S, topk, sp_b, sp_t)
        prefix = need.to(tl.uint32) * 0
        resolved = need * 0
    else:
        prefix = tl.load(state_row + 3 * (LEVEL - 2)).to(tl.uint32, bitcast=True)
        need = tl.load(state_row + 3 * (LEVEL - 2) + 1)
        resolved = tl.load(state_row + 3 * (LEVEL - 2) + 2)
    d, left, in_bin = _find_digit(hist_row_ptr + (LEVEL - 1) * NB, need, NB)
    # A resolved row's histogram was skipped (all zeros): keep its state instead of this find.
    prefix = tl.where(resolved != 0, prefix, prefix | (d.to(tl.uint32) << (32 - LEVEL * BITS)))
    need = tl.where(resolved != 0, need, left)
    resolved = tl.where(resolved != 0, resolved, (left == in_bin).to(tl.int32))
    if tl.program_id(1) == 0:
        tl.store(state_row + 3 * (LEVEL - 1), prefix.to(tl.int32, bitcast=True))
        tl.store(state_row + 3 * (LEVEL - 1) + 1, need)
        tl.store(state_row + 3 * (LEVEL - 1) + 2, resolved)
    return prefix, need, resolved


# T, the tile count and the query positions' address (a slice of the step's metadata) are not specialised on
# divisibility, so a new prompt length compiles no new variant;
# T = 1, decode, keeps its variant. S stays specialised: the masks on it decide the vector loads.
@triton.jit(do_not_specialize_on_alignment=["T", "sp_b", "qpos_ptr"])
def _hist_kernel(scores_ptr, qpos_ptr, hist_ptr, state_ptr, T, S, topk, ss_b, ss_t, ss_s, sp_b, sp_t,
                 LEVEL: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr, PASSES: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Pass LEVEL: histogram of digit LEVEL (bits 32 - (LEVEL+1)*BITS and up) of the candidates whose
    higher digits equal the prefix found so far, added into hist[row, LEVEL*NB : (LEVEL+1)*NB]."""
    row = tl.program_id(0)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    hist_row = hist_ptr + row.to(tl.int64) * (NB * PASSES)
    resolved = 0
    if LEVEL > 0:
        prefix, _, resolved = _threshold(hist_row, state_ptr, qpos_ptr, row, T, S, topk, sp_b, sp_t, LEVEL,
                                         NB, BITS, PASSES)
    if resolved == 0:
        u, take = _keys(scores_ptr, qpos_ptr, row, pos, T, S, ss_b, ss_t, ss_s, sp_b, sp_t)
        if LEVEL > 0:
            take = take & ((u >> (32 - LEVEL * BITS)) == (prefix >> (32 - LEVEL * BITS)))
        digit = ((u >> (32 - (LEVEL + 1) * BITS)) & (NB - 1)).to(tl.int32)
        # Keys not taken are counted in bin 0 and taken off again (no masked histogram in every triton).
        counts = tl.histogram(tl.where(take, digit, 0), NB)
        bins = tl.arange(0, NB)
        counts -= tl.where(bins == 0, tl.sum((~take).to(tl.int32), axis=0), 0)
        tl.atomic_add(hist_row + LEVEL * NB + bins, counts, mask=counts > 0, sem="relaxed")


@triton.jit(do_not_specialize_on_alignment=["T", "n_tiles", "sp_b", "qpos_ptr"])
def _count_kernel(scores_ptr, qpos_ptr, hist_ptr, state_ptr, counts_ptr, T, S, topk, n_tiles,
                  ss_b, ss_t, ss_s, sp_b, sp_t, NB: tl.constexpr, BITS: tl.constexpr, PASSES: tl.constexpr,
                  BLOCK: tl.constexpr):
    """After the last histogram: the exact threshold, then per tile the candidates above and equal to it."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    thr, _, _ = _threshold(hist_ptr + row.to(tl.int64) * (NB * PASSES), state_ptr, qpos_ptr, row, T, S, topk,
                           sp_b, sp_t, PASSES, NB, BITS, PASSES)
    pos = tile * BLOCK + tl.arange(0, BLOCK)
    u, cand = _keys(scores_ptr, qpos_ptr, row, pos, T, S, ss_b, ss_t, ss_s, sp_b, sp_t)
    c = counts_ptr + (row.to(tl.int64) * n_tiles + tile) * 2
    tl.store(c, tl.sum((cand & (u > thr)).to(tl.int32), axis=0))
    tl.store(c + 1, tl.sum((cand & (u == thr)).to(tl.int32), axis=0))


@triton.jit(do_not_specialize_on_alignment=["T", "n_tiles", "sp_b", "qpos_ptr"])
def _compact_kernel(scores_ptr, qpos_ptr, state_ptr, counts_ptr, sel_ptr, T, S, topk, n_tiles,
                    ss_b, ss_t, ss_s, sp_b, sp_t, PASSES: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Every selected key, packed as (u << 31) | (2^31 - 1 - position), to its own slot of sel[row, :n]:
    the keys above thr in position order, then the ``need`` lowest positions equal to thr."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    state_row = state_ptr + row.to(tl.int64) * (3 * PASSES) + 3 * (PASSES - 1)
    thr = tl.load(state_row).to(tl.uint32, bitcast=True)
    need = tl.load(state_row + 1)
    tiles = tl.arange(0, TILES)
    c = counts_ptr + row.to(tl.int64) * n_tiles * 2 + tiles * 2
    above_t = tl.load(c, mask=tiles < n_tiles, other=0)
    equal_t = tl.load(c + 1, mask=tiles < n_tiles, other=0)
    above_before = tl.sum(tl.where(tiles < tile, above_t, 0), axis=0)
    equal_before = tl.sum(tl.where(tiles < tile, equal_t, 0), axis=0)
    pos = tile * BLOCK + tl.arange(0, BLOCK)
    u, cand = _keys(scores_ptr, qpos_ptr, row, pos, T, S, ss_b, ss_t, ss_s, sp_b, sp_t)
    above = cand & (u > thr)
    equal = cand & (u == thr)
    equal_rank = equal_before + tl.cumsum(equal.to(tl.int32), axis=0) - 1
    slot = tl.where(above, above_before + tl.cumsum(above.to(tl.int32), axis=0) - 1,
                    tl.sum(above_t, axis=0) + equal_rank)
    tl.store(sel_ptr + row.to(tl.int64) * topk + slot, _pack(u, pos), mask=above | (equal & (equal_rank < need)))


@triton.jit(do_not_specialize_on_alignment=["T", "sp_b", "qpos_ptr"])
def _sort_kernel(sel_ptr, qpos_ptr, out_ptr, T, S, topk, sp_b, sp_t, K_PAD: tl.constexpr):
    """One row: its n packed keys sorted descending -> positions; -1 in slots n .. topk-1."""
    row = tl.program_id(0)
    n = _first_need(qpos_ptr, row, T, S, topk, sp_b, sp_t)
    base = row.to(tl.int64) * topk
    i = tl.arange(0, K_PAD)
    pos = _sorted_positions(tl.load(sel_ptr + base + i, mask=i < n, other=-1), i, n)
    tl.store(out_ptr + base + i, pos, mask=i < topk)


@triton.jit(do_not_specialize_on_alignment=["T", "sp_b", "qpos_ptr"])
def _row_sort_kernel(scores_ptr, qpos_ptr, out_ptr, T, S, topk, ss_b, ss_t, ss_s, sp_b, sp_t,
                     S_PAD: tl.constexpr):
    """A short row whole: every candidate packed with its position, sorted descending; the first n
    become the output, the rest of the topk slots -1 (non-candidates pack to -1, below every key)."""
    row = tl.program_id(0)
    pos = tl.arange(0, S_PAD)
    u, cand = _keys(scores_ptr, qpos_ptr, row, pos, T, S, ss_b, ss_t, ss_s, sp_b, sp_t)
    n = _first_need(qpos_ptr, row, T, S, topk, sp_b, sp_t)
    base = out_ptr + row.to(tl.int64) * topk
    tl.store(base + pos, _sorted_positions(tl.where(cand, _pack(u, pos), -1), pos, n), mask=pos < topk)
    for j0 in range(S_PAD, topk, S_PAD):  # topk > S: the slots past the row are padding
        tl.store(base + j0 + pos, tl.full([S_PAD], -1, tl.int32), mask=j0 + pos < topk)


def topk_indices(scores: torch.Tensor, topk: int, q_pos: torch.Tensor) -> torch.Tensor:
    """Causal top-k: the contract of ``topk_indices_ref`` (int32 [B, T, topk], ties to the lower position,
    -1 padding), by radix select and a sort of the selected keys (see the module docstring)."""
    B, T, S = check_topk_args(scores, topk, q_pos)
    if scores.dtype == torch.float64 or scores.numel() == 0 or S >= 2 ** 31:
        return topk_indices_ref(scores, topk, q_pos)
    R = B * T
    dev = scores.device
    cuda = dev.type == "cuda"
    if S <= _ROW_SORT_MAX_S:
        out = torch.empty(R, topk, dtype=torch.int32, device=dev)
        _row_sort_kernel[(R,)](scores, q_pos, out, T, S, topk, *scores.stride(), *q_pos.stride(),
                               S_PAD=max(2, triton.next_power_of_2(S)), num_warps=_SORT_WARPS if cuda else 1)
        return out.view(B, T, topk)
    # The interpreter pays per program instance: small tiles keep its tests to a few programs per row.
    block = min(_BLOCK if cuda else 64, max(16, triton.next_power_of_2(S)))
    n_tiles = triton.cdiv(S, block)
    hist = torch.zeros(R, _PASSES * _NB, dtype=torch.int32, device=dev)
    state = torch.empty(R, _STATE * _PASSES, dtype=torch.int32, device=dev)
    counts = torch.empty(R, n_tiles, 2, dtype=torch.int32, device=dev)
    sel = torch.empty(R, topk, dtype=torch.int64, device=dev)
    out = torch.empty(R, topk, dtype=torch.int32, device=dev)
    grid = (R, n_tiles)
    args = (scores, q_pos)
    strides = (*scores.stride(), *q_pos.stride())
    digits = dict(NB=_NB, BITS=_DIGIT_BITS, PASSES=_PASSES)
    warps = _WARPS if cuda else 1
    for level in range(_PASSES):
        _hist_kernel[grid](*args, hist, state, T, S, topk, *strides, LEVEL=level, **digits, BLOCK=block,
                           num_warps=warps)
    _count_kernel[grid](*args, hist, state, counts, T, S, topk, n_tiles, *strides, **digits, BLOCK=block,
                        num_warps=warps)
    _compact_kernel[grid](*args, state, counts, sel, T, S, topk, n_tiles, *strides, PASSES=_PASSES, BLOCK=block,
                          TILES=max(2, triton.next_power_of_2(n_tiles)), num_warps=warps)
    _sort_kernel[(R,)](sel, q_pos, out, T, S, topk, *q_pos.stride(), K_PAD=max(2, triton.next_power_of_2(topk)),
                       num_warps=_SORT_WARPS if cuda else 1)
    return out.view(B, T, topk)
