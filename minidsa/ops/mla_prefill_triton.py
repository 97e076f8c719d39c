"""Triton kernels for sparse MLA prefill: masked attention over each query tile's union of selected
positions, in decompressed (MHA) form; the absorbed form of mla_attention_triton.py where that is faster.

Same contract and signature as ``mla_attention.sparse_mla_prefill_ref`` (docs/design.md §4, §12): q
[B, T, H, dn + dr] against the paged latent planes at the positions the indexer selected, out [B, T,
H, dv] fp32. The reference gathers, per tile of 64 queries, the union of the cache blocks the tile
selected, decompresses them and attends with remapped indices. The union form here aggregates the
same way at the granularity of single positions:

1. Decompress once: the latent rows of positions 0 .. S-1 (S = the highest selected position + 1) are
   read through the block table in logical order and multiplied by W_kvb in one GEMM, kv [B, S, H,
   dn + dv] in the weight's dtype (the reference's rounding); k_pe [B, S, dr] stays one vector per
   position, shared by the heads.
2. ``_mark_chosen`` (one program per query) stores a 1 in chosen[tile, pos] for each valid selected
   pos (not -1, inside the block table, its block not -1: the reference's padding rule). A cumulative
   sum gives each chosen position its slot in the tile's union, and ``_compact`` writes the sorted
   union list [B, n_tiles, S] and its count.
3. ``_mark_mask`` (one program per query) writes the query's row of its tile's byte mask: [BLOCK_M,
   stride] per tile, 1 at the union slot of each position the query selected, stride = count rounded
   up to BLOCK_N. Every store writes a 1 or a distinct value, so the result does not depend on order.
   The mask takes BLOCK_M bytes per union slot: 0.15 GB at T = 32k when a tile's union is 2.3x top-k,
   0.56 GB when it is the whole prefix (then the absorbed form runs, unless forced).
4. ``_union_attn_fwd``, one program per (head, tile, sequence): FlashAttention over the tile's union
   list, BLOCK_N slots at a time:

       pos  = union[n0 : n0 + BLOCK_N]                       gathered rows of this head's k, v
       s    = q_nope @ k_nope[pos]^T + q_pe @ k_pe[pos]^T     [BLOCK_M, BLOCK_N]
       s    = -inf where mask[query, slot] = 0
       online softmax (fp32, base 2);  acc = acc * alpha + p @ v[pos]

   The mask rows are padded (zeros past count and past T) so their loads need no bounds and are
   16-byte vectors, staged by the pipeliner like the k, v rows. (Loaded by hand one iteration ahead, the
   carried mask kept its load layout and the compiler ran the softmax twice, in that layout for the row
   sums and in the dot's for p: 66 exp2 per thread per chunk instead of 34, 913 SASS instructions
   instead of 770, and 4.56 against 5.75 ms of attention at 79 % overlap below.) Heads vary fastest in the grid: the
   H programs of a tile run together and share its list and mask in L2; the last tiles (longest
   unions) start first.

Why positions and not blocks: a tile costs BLOCK_M x (union size) x 2 (dn + dr + dv) FLOPs per head,
and a union of positions is never larger than the union of the blocks holding them. When neighbouring
queries keep most of each other's picks (an indexer's scores move slowly from one query to the next)
a tile's union is a small multiple of top-k even when the picks are scattered over the whole prefix,
while 2,048 scattered picks touch nearly every 64-position block. A gathered position is one row of
dn (or dv) values per head, as a block's position would be.

Which form runs (``use_union_form``, FORM = "auto"): the union form costs per selected pair (marks,
masks, decompression) plus per (query, union slot) pair; the absorbed form (W_UK folded into q, the
latent kernel over each query's own rows, W_UV after; 3.4x the FLOPs per pair at the K3 dims, but one
gathered latent row serves all heads) costs per selected pair. The ratio of union pairs to selected
pairs is taken from DECISION_TILES evenly spaced tiles before anything else is built and compared with
UNION_BREAK_EVEN (measured at 16 heads; scaled by 16 / H for more heads, an extrapolation). FORM =
"union" / "absorbed" forces one (tests, benchmarks).

Measured on the H200 (benchmarks/bench_mla.py, bf16, T=32,768, top-k 2048, H=16, dn=dv=128, dr=64,
r=512, triton 3.6, one run, 2026-12-01) with three selection patterns: independent random picks, and
picks of a shared per-position importance plus noise, where the next query keeps 62 % or 79 % of a
query's picks:

  selections (64-query tile union / top-k)   op        union form   absorbed form   dense causal SDPA
  independent (8.47)                         18.1 ms   17.8 ms      17.2 ms          9.4 ms
  next query keeps 62 % (3.48)                9.8 ms    9.5 ms      17.2 ms
  next query keeps 79 % (2.11)                7.0 ms    6.8 ms      17.2 ms

The op pays 0.2-1 ms over the form it picks for the decision (a max over the indices, the sampled
unions, one sync). The union form with independent picks is masked dense attention over the whole
prefix: 5.52 TFLOP at 310 TFLOP/s. At 79 %: the attention kernel 3.9 ms (1.51 TFLOP, 385 TFLOP/s; the
mask loads and selects cost 0.2 ms of it), unions 1.3 ms (``_mark_chosen`` stores 67 M scattered bytes
in about 1 ms), masks 1.2 ms (``_mark_mask`` as many), decompression 0.4 ms.

The floor of issue 9 (2x faster than dense causal SDPA: 4.7 ms) is not met. With independent picks no
form here can: the union is the whole prefix, and the absorbed form must gather 74.9 GB of rows (module
docstring of mla_attention_triton.py). With overlapping picks the union form is 1.33x faster than dense
at 79 %; its fixed costs alone (2.9 ms) leave 1.8 ms for 1.51 TFLOP of attention, more than the peak
rate. Meeting the floor needs a union build that does not store one scattered byte per selected pair
twice, and attention nearer FlashAttention-3's rate, or picks that overlap more than these.

Masks and padding: a query with no valid position keeps l = 0 and gets zeros, like the reference. A row
of the union that one query of the tile selected is read for every query of the tile (with p = 0 for
the others), so a NaN stored in that row reaches the whole tile, where the reference reads it only for
the queries that selected it; rows no query of the tile selected are never read.

Precision: fp32 accumulation and softmax; bf16/fp16 kv gives tensor-core dots on q and p cast to that
dtype; fp32 kv runs input_precision="ieee" (no TF32). fp64 inputs go to the reference.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .mla_attention import check_prefill_args, sparse_mla_prefill_ref
from .mla_attention_triton import (_LOG2E, INT32_OFFSETS_BELOW, _rows_at, _softmax_step,
                                   sparse_mla_prefill_absorbed)
from .paging import gather_slots, paged_slots

# Which form runs: "auto" picks per call (use_union_form); "union" / "absorbed" force one (tests, benchmarks).
FORM = os.environ.get("MINIDSA_PREFILL_FORM", "auto")
# Pairs (query, union slot) per pair (query, selected position) below which the union form is faster. Measured
# on the H200 (T=32,768, top-k 2048, H=16, K3 dims, bf16, 128-query tiles; three selection patterns, GPU time):
# the union form costs 5.0e-11 s per selected pair (unions, masks, decompression) plus 2.8e-11 s per union
# pair, the absorbed form 2.62e-10 s per selected pair: (2.62 - 0.50) / 0.28 = 7.6.
UNION_BREAK_EVEN = 7.5
# Tiles whose unions are built to estimate the union form's work before choosing (evenly spaced, last included).
DECISION_TILES = 16


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


@triton.jit
def _mark_chosen(idx_ptr, table_ptr, chosen_ptr, T, K, S, max_blocks, n_tiles, s_ib, s_it, s_tb,
                 BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One query (b, t): chosen[b, tile(t), pos] = 1 for each valid selected pos. Queries of one tile
    store the same 1 to the same bytes: the order does not matter."""
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // T, bt % T
    row = chosen_ptr + (b * n_tiles + t // BLOCK_M) * S
    for k0 in range(0, K, BLOCK_K):
        pos, valid = _selected(idx_ptr, table_ptr, b, t, k0, T, K, S, max_blocks, s_ib, s_it, s_tb, BS, BLOCK_K)
        tl.store(row + pos, tl.full([BLOCK_K], 1, tl.uint8), mask=valid)


@triton.jit
def _compact(chosen_ptr, rank_ptr, union_ptr, S, L, BLOCK: tl.constexpr):
    """union[b, tile, rank[pos]] = pos for every chosen pos: the tile's union, sorted by position."""
    bi = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = pos < S
    chosen = tl.load(chosen_ptr + bi * S + pos, mask=inside, other=0) != 0
    rank = tl.load(rank_ptr + bi * S + pos, mask=inside, other=0)
    tl.store(union_ptr + bi * L + rank, pos, mask=chosen)


@triton.jit
def _mark_mask(idx_ptr, table_ptr, rank_ptr, mask_ptr, mask_off_ptr, stride_ptr, T, K, S, max_blocks, n_tiles,
               s_ib, s_it, s_tb, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One query (b, t): its row of the tile mask, 1 at the union slot of each valid selected pos."""
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // T, bt % T
    bi = b * n_tiles + t // BLOCK_M
    row = mask_ptr + tl.load(mask_off_ptr + bi) + (t % BLOCK_M) * tl.load(stride_ptr + bi)
    for k0 in range(0, K, BLOCK_K):
        pos, valid = _selected(idx_ptr, table_ptr, b, t, k0, T, K, S, max_blocks, s_ib, s_it, s_tb, BS, BLOCK_K)
        slot = tl.load(rank_ptr + bi * S + pos, mask=valid, other=0)
        tl.store(row + slot, tl.full([BLOCK_K], 1, tl.uint8), mask=valid)


@triton.jit
def _union_attn_fwd(q_ptr, kv_ptr, pe_ptr, mask_ptr, mask_off_ptr, union_ptr, count_ptr, o_ptr,
                    T, L, n_tiles, qk_scale,
                    s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_pb, s_ps, s_ob, s_ot, s_oh,
                    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr,
                    BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, OFF64: tl.constexpr):
    # Heads vary fastest: the H programs of a tile run together and share its union list and masks in L2.
    h = tl.program_id(0).to(tl.int64)
    tile = n_tiles - 1 - tl.program_id(1)  # the longest unions (the last tiles) start first
    b = tl.program_id(2).to(tl.int64)
    dot_dtype = kv_ptr.dtype.element_ty
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    if OFF64:  # tensors of 2^31 elements or more: row offsets in int64 (else int32, half the arithmetic)
        rows = rows.to(tl.int64)
    q_row = q_ptr + b * s_qb + h * s_qh
    q_nope = _rows_at(q_row, rows * s_qt, row_ok, DN, BLOCK_DN).to(dot_dtype)
    q_pe = _rows_at(q_row + DN, rows * s_qt, row_ok, DR, BLOCK_DR).to(dot_dtype)
    k_row, v_row, pe_row = kv_ptr + b * s_kb + h * s_kh, kv_ptr + b * s_kb + h * s_kh + DN, pe_ptr + b * s_pb
    union = union_ptr + (b * n_tiles + tile) * L
    count = tl.load(count_ptr + b * n_tiles + tile)
    # The tile's mask [BLOCK_M, stride]: stride = count rounded up to BLOCK_N, zeros past count and T, so its
    # loads are unbounded 16-byte vectors staged by the pipeliner (why it is not carried: module docstring).
    stride = tl.multiple_of((count + BLOCK_N - 1) // BLOCK_N * BLOCK_N, 16)
    mask_start = tl.multiple_of(tl.load(mask_off_ptr + b * n_tiles + tile), 16)
    mask_rows = mask_ptr + mask_start + tl.arange(0, BLOCK_M).to(tl.int64)[:, None] * stride
    chunk = tl.arange(0, BLOCK_N)[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(0, count, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < count
        pos = tl.load(union + n, mask=n_ok, other=0)
        if OFF64:
            pos = pos.to(tl.int64)
        k = _rows_at(k_row, pos * s_ks, n_ok, DN, BLOCK_DN)  # [BLOCK_N, BLOCK_DN]
        pe = _rows_at(pe_row, pos * s_ps, n_ok, DR, BLOCK_DR)
        v = _rows_at(v_row, pos * s_ks, n_ok, DV, BLOCK_DV)
        s = tl.dot(q_nope, tl.trans(k), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION)
        chosen = tl.load(mask_rows + n0 + chunk) != 0
        s = tl.where(chosen, s * qk_scale, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)  # the decode kernel's online-softmax step
        acc = tl.dot(p.to(dot_dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    cols = tl.arange(0, BLOCK_DV)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a query with nothing selected: acc = 0, stays 0
    tl.store(o_ptr + b * s_ob + rows[:, None] * s_ot + h * s_oh + cols[None, :], o,
             mask=row_ok[:, None] & (cols < DV)[None, :])


def _blocks(on_gpu: bool, elt: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Measured on the H200 (bf16, T=32,768, H=16, top-k 2048,
    attention kernel alone, 2026-12-01), for independent picks / picks whose next query keeps 62 % / 79 %:
    128 x 32, 8 warps, 3 stages 14.0 / 6.6 / 3.9 ms; 64 x 64, 4 warps, 3 stages 16.9 / 7.3 / 4.6; 64 x 32,
    4 warps, 3 stages 16.9 / 7.3 / 4.5; 128 x 64, 8 warps, 3 stages 18.7 / 8.7 / 5.2; 2 stages slower in
    each. The interpreter costs ~4 ms per program instance and loop step: CPU runs take the smallest tiles."""
    if not on_gpu:
        return 16, 16, 4, 1
    if elt >= 4:  # fp32 kv: twice the bytes per row and per register
        return 64, 32, 4, 2
    return 128, 32, 8, 3


def _decompress(kv_latent_plane, k_pe_plane, block_table, kv_b_weight, B: int, S: int, H: int):
    """Positions 0..S-1 of each sequence, decompressed: (kv [B, S, H, dn+dv], k_pe [B, S, dr]) in the
    weight's dtype. Positions without a block are zero rows (never selected, never read)."""
    positions = torch.arange(S, device=block_table.device).expand(B, S)
    slots = paged_slots(block_table, positions, kv_latent_plane.shape[1])  # one address computation, two planes
    wdt = kv_b_weight.dtype
    latent = gather_slots(kv_latent_plane, slots).to(wdt)
    kv = F.linear(latent, kv_b_weight).view(B, S, H, -1)
    return kv, gather_slots(k_pe_plane, slots).to(wdt).contiguous()


def _block_k(K: int, on_gpu: bool) -> int:
    """Selections per step of the marking kernels: 256 with 2 warps measured 1.0 ms for _mark_chosen at
    T=32,768, top-k 2048 on the H200 (512 / 4 warps 1.1, 1024 / 4 warps 1.2, 2048 / 8 warps 1.5)."""
    return min(256 if on_gpu else 64, triton.next_power_of_2(K))


def _chosen(idx, table, bs: int, B: int, T: int, S: int, BLOCK_M: int, on_gpu: bool) -> torch.Tensor:
    """uint8 [B * n_tiles, S]: 1 where some query of the tile selected that valid position."""
    K = idx.shape[-1]
    n_tiles = triton.cdiv(T, BLOCK_M)
    chosen = torch.zeros(B * n_tiles, S, dtype=torch.uint8, device=idx.device)
    _mark_chosen[(B * T,)](idx, table, chosen, T, K, S, table.shape[1], n_tiles, idx.stride(0), idx.stride(1),
                           table.stride(0), BS=bs, BLOCK_M=BLOCK_M, BLOCK_K=_block_k(K, on_gpu), num_warps=2)
    return chosen


def _tile_unions(idx, table, bs: int, B: int, T: int, S: int, BLOCK_M: int, on_gpu: bool):
    """Per tile of BLOCK_M queries, the sorted union of the valid positions its queries selected.

    idx int32 [B, T, K], table int32 [B, max_blocks] -> (rank int32 [B*n_tiles, S]: a chosen position's
    slot in its tile's union; union int32 [B, n_tiles, S]: the first count[b, tile] entries are the
    positions; count int32 [B, n_tiles]). No host sync.
    """
    chosen = _chosen(idx, table, bs, B, T, S, BLOCK_M, on_gpu)
    rank = torch.cumsum(chosen, -1, dtype=torch.int32) - 1
    count = (rank[:, -1] + 1).view(B, -1)
    union = torch.zeros_like(rank)
    block = min(1024 if on_gpu else 64, triton.next_power_of_2(S))
    _compact[(chosen.shape[0], triton.cdiv(S, block))](chosen, rank, union, S, S, BLOCK=block)
    return rank, union.view(B, -1, S), count


def _tile_masks(idx, table, rank, stride, total: int, bs: int, T: int, S: int, BLOCK_M: int, BLOCK_N: int,
                on_gpu: bool):
    """Each query's selection as bytes over its tile's union: (mask uint8, mask_off int64 [B * n_tiles]).

    Tile i is [BLOCK_M, stride[i]] at mask_off[i] (stride = count rounded up to BLOCK_N), 1 where the
    query selected that union slot. Zeros past count and past T let the attention loop load every chunk
    without bounds.
    """
    sizes = stride * BLOCK_M
    mask_off = torch.cumsum(sizes, 0) - sizes
    mask = torch.zeros(max(1, total * BLOCK_M), dtype=torch.uint8, device=idx.device)
    K = idx.shape[-1]
    _mark_mask[(idx.shape[0] * T,)](idx, table, rank, mask, mask_off, stride, T, K, S, table.shape[1],
                                    stride.numel() // idx.shape[0], idx.stride(0), idx.stride(1), table.stride(0),
                                    BS=bs, BLOCK_M=BLOCK_M, BLOCK_K=_block_k(K, on_gpu), num_warps=2)
    return mask, mask_off


def _attend(q, kv, k_pe, union, count, mask, mask_off, out, dn: int, scale: float, BLOCK_M: int, BLOCK_N: int,
            num_warps: int, num_stages: int) -> None:
    """Launch _union_attn_fwd: q [B, T, H, dn+dr], kv [B, S, H, dn+dv], k_pe [B, S, dr] -> out [B, T, H, dv]."""
    B, T, H, dq = q.shape
    dr, dv, n_tiles = dq - dn, out.shape[-1], union.shape[1]
    _union_attn_fwd[(H, n_tiles, B)](
        q, kv, k_pe, mask, mask_off, union, count, out, T, union.shape[-1], n_tiles, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), k_pe.stride(0),
        k_pe.stride(1), out.stride(0), out.stride(1), out.stride(2),
        DN=dn, DR=dr, DV=dv, BLOCK_DN=max(16, triton.next_power_of_2(dn)),
        BLOCK_DR=max(16, triton.next_power_of_2(dr)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION="ieee" if kv.element_size() >= 4 else "tf32",
        OFF64=max(q.numel(), kv.numel(), out.numel()) >= INT32_OFFSETS_BELOW,  # the decode kernel's limit
        num_warps=num_warps, num_stages=num_stages)


def use_union_form(union_pairs: float, selected: int, heads: int = 16) -> bool:
    """Whether the union form is expected to beat the absorbed form: FORM, or for "auto" the ratio of
    (query, union slot) pairs to (query, selected position) pairs against UNION_BREAK_EVEN (measured with
    16 heads). With more heads the threshold shrinks as 16 / heads: the union form's work grows with the
    heads, the absorbed form's gathers (what bind it at 16) do not. That scaling is an extrapolation, not
    a measurement; it errs towards the absorbed form."""
    if FORM not in ("auto", "union", "absorbed"):
        raise ValueError(f"mla_prefill_triton.FORM is {FORM!r}; use 'auto', 'union' or 'absorbed'")
    if FORM != "auto":
        return FORM == "union"
    return union_pairs < UNION_BREAK_EVEN * min(1.0, 16 / heads) * selected


def _plan(idx, table, bs: int, B: int, T: int, H: int, BLOCK_M: int, on_gpu: bool) -> tuple[int, bool]:
    """(S = highest selected position + 1, whether the union form runs), in one host sync (prefill may
    synchronise; decode never does). For FORM = "auto" the ratio of union pairs to selected pairs is
    taken from DECISION_TILES evenly spaced tiles (all tiles when there are fewer), before anything else
    is built: a call that ends in the absorbed form builds no unions."""
    stats = [idx.max()]
    if FORM == "auto":
        n_tiles, S_all, K = triton.cdiv(T, BLOCK_M), table.shape[1] * bs, idx.shape[-1]
        tiles = torch.linspace(0, n_tiles - 1, min(n_tiles, DECISION_TILES), device=idx.device).round().long()
        rows = tiles[:, None] * BLOCK_M + torch.arange(BLOCK_M, device=idx.device)  # [tiles, BLOCK_M]
        real = rows < T
        sub = idx[:, rows.clamp_max(T - 1).view(-1)].contiguous()  # rows past T repeat the last query
        # A sum of the chosen bytes (a cumulative sum over these few long rows would be slow on the GPU).
        count = _chosen(sub, table, bs, B, rows.numel(), S_all, BLOCK_M, on_gpu).view(B, -1, S_all).sum(-1)
        stats += [(count * real.sum(-1)).sum(), ((sub.view(B, *rows.shape, K) >= 0) & real[..., None]).sum()]
    top, *ratio = torch.stack([x.double() for x in stats]).tolist()
    S = min(int(top) + 1, table.shape[1] * bs)
    return S, S > 0 and use_union_form(*(ratio or (0.0, 0)), heads=H)


def sparse_mla_prefill(q: torch.Tensor, kv_latent_plane: torch.Tensor, k_pe_plane: torch.Tensor,
                       block_table: torch.Tensor, indices: torch.Tensor, kv_b_weight: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Sparse MLA prefill: the contract, shapes and dtypes of ``sparse_mla_prefill_ref``. Masked attention
    over each query tile's union of selected positions, or the absorbed per-query form when the unions are
    too large for that to pay (see the module docstring)."""
    B, T, H, dn, dv = check_prefill_args(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight)
    if torch.float64 in (q.dtype, kv_latent_plane.dtype, k_pe_plane.dtype, kv_b_weight.dtype):
        return sparse_mla_prefill_ref(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale)
    if B * T == 0 or indices.shape[-1] == 0 or FORM == "absorbed":
        return sparse_mla_prefill_absorbed(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale)
    bs, on_gpu = kv_latent_plane.shape[1], q.device.type == "cuda"
    BLOCK_M, BLOCK_N, num_warps, num_stages = _blocks(on_gpu, kv_b_weight.element_size())
    idx, table = indices.to(torch.int32), block_table.to(torch.int32)
    S, union_form = _plan(idx, table, bs, B, T, H, BLOCK_M, on_gpu)
    if not union_form:  # (S = 0: nothing selected anywhere; the absorbed form returns zeros)
        return sparse_mla_prefill_absorbed(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale)
    rank, union, count = _tile_unions(idx, table, bs, B, T, S, BLOCK_M, on_gpu)
    stride = (count.view(-1).long() + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    kv, k_pe = _decompress(kv_latent_plane, k_pe_plane, block_table, kv_b_weight, B, S, H)
    mask, mask_off = _tile_masks(idx, table, rank, stride, int(stride.sum()), bs, T, S, BLOCK_M, BLOCK_N, on_gpu)
    out = torch.empty(B, T, H, dv, dtype=torch.float32, device=q.device)
    _attend(q if q.stride(-1) == 1 else q.contiguous(), kv, k_pe, union, count, mask, mask_off, out, dn, scale,
            BLOCK_M, BLOCK_N, num_warps, num_stages)
    return out
