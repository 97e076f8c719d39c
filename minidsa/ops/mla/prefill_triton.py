"""Triton kernels for sparse MLA prefill: masked attention over each query tile's union of selected
positions, in decompressed (MHA) form; the absorbed form of mla_attention_triton.py where that is faster.

Same contract and signature as ``mla_attention.sparse_mla_prefill_ref`` (docs/design.md §4, §12): q
[B, T, H, dn + dr] against the paged latent planes at the positions the indexer selected, out [B, T,
H, dv] fp32. The reference gathers, per tile of 64 queries, the union of the cache blocks the tile
selected, decompresses them and attends with remapped indices. The union form here aggregates the
same way at the granularity of single positions:

1. Decompress once: the positions below S (the block table's reach, or the highest selection + 1 when the
   table reaches past twice the prompt; sparse_mla_prefill), read block by block in logical order and
   multiplied by W_kvb in one GEMM, kv [B, S, H, dn + dv] in the weight's dtype (the reference's
   rounding); k_pe [B, S, dr] stays one vector per position, shared by the heads.
2. ``_mark_bits`` (one program per query) sets one bit per valid selected pos (not -1, inside the
   block table, its block not -1: the reference's padding rule) in the query's bit row, [B * T,
   ceil(S / 32)] int32, with an atomic OR, and counts the valid selections. ``_tile_union`` (one
   program per tile) ORs its queries' rows word by word and unpacks the set bits, in order, into the
   sorted union list [B, n_tiles, S] and its count.
3. ``_mask_row`` (one program per query) writes the query's column of its tile's mask: [ceil(count /
   32), BLOCK_M] int32 per tile, bit j of word (c, m) = query m's bit for position union[c * 32 + j]. It
   reads the union list in order and looks bits up in its own 4 KB row. Chunk-major, so that the
   attention loop reads a chunk's 128 words as one 512-byte run (tile-row-major, 128 words 600 bytes
   apart, the attention took 3 % longer). The mask takes BLOCK_M / 8 bytes per union slot: 18 MB at T =
   32k when a tile's union is 2.3x top-k, 67 MB when it is the whole prefix. The bit rows take T x S / 8
   bytes (128 MB at T = S = 32k, 2 GB at 128k; the byte build before took 5 x T x S / 128: 0.64 GB at
   128k); a longer prefill would have to build them per range of tiles.
   Why bits: the previous build stored a byte per selected pair twice, at scattered addresses (a byte
   per (tile, position) whose cumulative sum ranked the union, then a byte per mask entry through that
   rank): 2.5 ms at T = 32k, top-k 2048, against 0.8 ms for these three kernels. Sorting each query's
   picks first would make the stores contiguous but costs more than it saves (torch.sort 1.8 ms,
   tl.sort in the marking kernel 3.2 ms).
4. ``_union_attn_fwd``, one program per (head, tile, sequence): FlashAttention over the tile's union
   list, BLOCK_N slots at a time:

       pos  = union[n0 : n0 + BLOCK_N]                       gathered rows of this head's k, v
       s    = q_nope @ k_nope[pos]^T + q_pe @ k_pe[pos]^T     [BLOCK_M, BLOCK_N]
       s    = -inf where mask[query, slot] = 0
       online softmax (fp32, base 2);  acc = acc * alpha + p @ v[pos]

   The mask words are padded (zeros past count and past T) so their loads need no bounds; they are
   staged by the pipeliner like the k, v rows. (A byte mask loaded by hand one iteration ahead kept its
   load layout and the compiler ran the softmax twice: 66 exp2 per thread per chunk instead of 34.)
   The positions of the next chunk, though, are loaded by hand one iteration ahead: loaded in the
   iteration, they made the pipeliner issue each chunk's gathers only one iteration ahead and wait for
   every copy at the top of the loop (SASS: DEPBAR.LE SB0, 0x0); carried, the gathers run a stage ahead
   (DEPBAR.LE SB0, 0x4). Two programs must share an SM to hide the latencies that remain: with the
   word masks the three stages take 111.6 KB of shared memory and fit twice; with byte masks (118.8 KB)
   or a fourth stage they do not, and the op took 6.5 ms instead of 5.1 at 79 % overlap below (4.6 and
   3.75 ms at 92 %). Heads vary fastest in the grid: the H programs of a tile run together and share its
   list and mask in L2; the last tiles (longest unions) start first.

Why positions and not blocks: a tile costs BLOCK_M x (union size) x 2 (dn + dr + dv) FLOPs per head,
and a union of positions is never larger than the union of the blocks holding them. When neighbouring
queries keep most of each other's picks (an indexer's scores move slowly from one query to the next)
a tile's union is a small multiple of top-k even when the picks are scattered over the whole prefix,
while 2,048 scattered picks touch nearly every 64-position block. A gathered position is one row of
dn (or dv) values per head, as a block's position would be.

Which form runs (``use_union_form``, FORM = "auto"): the union form costs per selected pair (marks,
decompression) plus per (query, union slot) pair; the absorbed form (W_UK folded into q, the latent
kernel over each query's own rows, W_UV after; 3.4x the FLOPs per pair at the K3 dims, but one gathered
latent row serves all heads) costs per selected pair. The unions are built first (cheap, and the union
form reuses them); their exact pair count against the selected pairs, compared with
union_break_even(H) (a cost model of both forms fitted at 16, 32, 64 and 96 heads), decides. The union
form's work grows with the heads, the absorbed form's with its programs of up to 64 heads, which share
their gathers: at the K3 shape (96 heads) the union form pays up to 4.1 pairs per selected pair. A call
that ends in the absorbed form has paid for the bits, the unions and the decompression (about 0.9 ms at T
= 32k, 5 % of that form's time). FORM = "union" / "absorbed" forces one (tests, benchmarks). Two host
syncs at most: S (the highest selection), only when the block table reaches past twice the prompt, and
the counts (pairs, selections, mask words), copied to pinned memory as soon as the unions are built; the
decompression is queued before the host waits for that copy, so the GPU has 0.2 ms of work while the
host wakes up and launches the masks and the attention.

On sm_90 the attention step runs ``mla_prefill_gluon.py`` where it fits (bf16/fp16, dn = dv, 128-query
tiles): this kernel's math with a producer warp group for the gathers and the query held in registers,
0.84-0.85x this kernel's time (its docstring says what each change bought).

Measured on the H200 (benchmarks/bench_mla.py, bf16, T=32,768, top-k 2048, H=16, dn=dv=128, dr=64,
r=512, triton 3.6, one run, 2026-12-01) with four selection patterns: independent random picks, and
picks of a shared per-position importance plus noise, where the next query keeps 62 %, 79 % or 92 % of
a query's picks; the union form with its attention on the Gluon kernel, and on this file's kernel:

  selections (64-query tile union / top-k)   op        union form (Triton's)   absorbed form   dense causal SDPA
  independent (8.47)                         11.6 ms   11.6 ms (13.9 ms)       17.1 ms          9.3 ms (op 0.80x)
  next query keeps 62 % (3.48)                6.0 ms    6.0 ms  (7.1 ms)       17.1 ms          (op 1.55x faster)
  next query keeps 79 % (2.11)                4.0 ms    4.1 ms  (4.6 ms)       17.2 ms          (op 2.35x faster)
  next query keeps 92 % (1.39)                2.9 ms    3.1 ms  (3.3 ms)       17.2 ms          (op 3.19x faster)

A second run of the whole benchmark: op 11.6 / 6.0 / 3.96 / 2.92 ms against dense SDPA's 9.12 ms (0.79x /
1.52x / 2.30x / 3.12x). At 79 %, in interleaved runs of the op (build/gpu, same day) it took 4.05-4.12 ms with
the Gluon kernel against 4.72-4.76 with this one and dense SDPA's 9.30 ms: 2.26-2.30x (this kernel alone:
1.91-2.03x over the day's runs). The GPU timeline with this file's kernel (torch profiler, consecutive calls):
bits zeroed 0.03 ms, marked 0.57, unions 0.065, counts copied, gathers 0.016 and the decompression GEMM 0.21
(while the host waits for the counts and launches the rest), masks 0.14, attention 3.47 ms (147 M union pairs,
1.51 TFLOP, 435 TFLOP/s; 3.65 ms alone with the L2 flushed first), with no gap between kernels. Before this
layout the op was 5.0-5.4 ms: two host syncs (the highest selection, then the counts and the mask's size) each
let the GPU run dry while the host woke up and issued a dozen small launches (0.9 ms of gaps in the timeline),
and the masks were tile-row-major (128 words at a stride per chunk; chunk-major: attention 3.83 -> 3.72 ms).
The union form with independent picks is masked dense attention over the whole prefix (5.52 TFLOP at 391
TFLOP/s here, 475 in Gluon): slower than dense SDPA, which runs the same FLOPs at 591 TFLOP/s.

The floor of issue 9 (2x faster than dense causal SDPA) holds when neighbouring queries keep 79 % of each
other's picks or more (2.26-2.35x at 79 % with the Gluon kernel, 3.19x at 92 %) and fails below (1.55x at 62
%). With independent picks no form here can meet it: the union is the whole prefix, and the absorbed form must
gather 74.9 GB of rows (module docstring of mla_attention_triton.py). Between, the attention kernel binds:
this file's at about half of the bf16 peak where FlashAttention reaches 75 % on dense tiles, the Gluon kernel
at 60 % (475-490 TFLOP/s), and not through memory traffic: at 79 % this file's kernel took (with the earlier
tile-row-major masks) 3.91 ms on the real unions, 3.86 ms with each tile's slots at contiguous positions and
3.81 ms with every position inside 2,048 rows (32 MB of kv, L2-resident). Tried and slower for this kernel
(attention kernel alone, same run): a first warp-specialised Gluon version (the one now in
mla_prefill_gluon.py, with the query in shared memory) 4.16-4.23 ms at 79 %, 2.80-2.90 against 2.56 at 92 %,
14.0-14.4 against 13.9 with independent picks; Triton's ``warp_specialize`` is ignored on sm_90 (same SASS);
the query in registers as the score dot's A operand (a computed q makes Triton pick that form, but it reloads
q from shared memory each iteration with ldmatrix: 169 registers, one program per SM; Gluon holds it, see
there); a lazy rescale (acc * alpha only when some row maximum grows by more than 2^8: a branch on a reduction
over the program, capped at 128 registers to keep two programs per SM) 5.5-5.6 against 5.1-5.3 ms for the
whole op at 79 %; 64-query tiles (``_blocks``); folding the scale into an FMA (382 instead of 398 instructions
per chunk) changed nothing measurable; 256-query tiles (16 warps, one program per SM: each gathered chunk
serves twice the queries) 4.00 against 3.65 ms at 79 % (the union grows to 2.43 pairs per selected pair, and
the kernel ran at 404 against 413 TFLOP/s). Tried for the fixed costs (same day): the decompression on a
second stream beside the marking. With cuBLAS it delays the marking by as much as it takes (0.82 ms for both,
0.85 one after the other: its programs fill the SMs); a slim persistent Triton GEMM (one program per SM, 128 x
256 tiles, 8 warps) ran beside it in 0.73 ms, but then nothing is queued while the host wakes up for the
counts, which the GEMM covers in the order used here. Masks written in place over the bit rows (no allocation,
so they could be queued before the sync) cost the attention the chunk-major layout: 4.68-4.88 ms for the op.

Splitting the union was measured and rejected (H200, 2026-12-01, the union form's op at 4.98 ms in that
run at 79 %). Most union slots that cost the union form its waste are positions few of the tile's queries
picked: keeping in the union only positions more than 12 of the 128 queries selected cuts it from 2.26 to
1.51 pairs per selected pair (attention 3.79 -> 2.55 ms), and leaves 48 picks per query (max 100: 2.3 % of
the picks) to the absorbed kernel, which took 3.88 ms for them (at 62 %: 6.24 -> 3.34 ms, the absorbed
kernel 6.2 ms for 117 picks per query). That kernel costs about 2 ms however short the lists (one program
per query, each a chunk or two; the q absorption alone is 0.19 ms), so the split pays only with a kernel
for short per-query lists that runs in well under 1 ms, absorptions included; none was written.

Compiled variants: Triton specialises integer arguments on divisibility by 16 (and on 1), so every prompt
length used to compile its own variants of these kernels. The lengths (T, S, the union's row length, the
tile count) are left unspecialised, and so are the strides that only scale them; the batch strides, which
set the alignment of the row loads, are not. Ten prompt lengths on a fresh process (H200, the K3 widths,
top-k 64): 23 variants and 9.4 s before, 9 and 2.1 s after, with the T = 32k times unchanged (5.35
against 5.46-5.50 ms at 79 %) and the outputs bitwise equal. 6 of the 9 were ``_tile_union``'s, whose
block width followed W; it is fixed now (after that measurement, not re-measured on the GPU).

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

from .latent_triton import _LOG2E, INT32_OFFSETS_BELOW, _rows_at, _softmax_step, sparse_mla_prefill_absorbed
from .reference import check_prefill_args, sparse_mla_prefill_ref

try:  # the sm_90 union kernel (Gluon); a triton without Gluon, or with another Gluon API, keeps this file's kernel
    from . import prefill_gluon as _gluon
except (ImportError, AttributeError):
    _gluon = None

# Which form runs: "auto" picks per call (use_union_form); "union" / "absorbed" force one (tests, benchmarks).
FORM = os.environ.get("MINIDSA_PREFILL_FORM", "auto")
# On sm_90, the union form's attention goes to the Gluon kernel where it fits (mla_prefill_gluon.py: 3.1 against
# 3.7 ms at T = 32k, 79 % overlap); False keeps it on this file's kernel. The decode kernels' switch, too.
USE_GLUON = os.environ.get("MINIDSA_MLA_GLUON", "1") != "0"
# The two forms' costs, fitted on the H200 (T=32,768, top-k 2048, K3 dims, bf16, 128-query tiles; each form
# forced, four selection patterns at 16, 32, 64 and 96 heads, 2026-12-01), in seconds. Union form: per
# selected pair 1.08e-11 + 4.4e-13 per head (bits, unions, decompression), plus 1.6e-12 per head and (query,
# union slot) pair (1.50-1.67e-12 at the four head counts). Absorbed form: per selected pair, which its gathers
# bind: 2.65e-10 up to 16 heads (the Triton kernel, 16-row tiles), else 3.45e-10 per 64 heads (the Gluon
# kernel's tiles on sm_90; 32 heads 3.04e-10, 96 heads 6.5e-10 measured). The model picked the faster form in
# 15 of the 16 measured cases (the miss: 96 heads, 3.8 pairs per selected pair, 4 % slower).
UNION_FIXED = (1.08e-11, 4.4e-13)
UNION_PER_HEAD_PAIR = 1.6e-12
# The Gluon kernel's per (head, union pair) cost: the Triton kernel's scaled by their measured ratio, 0.84-0.85 at
# three selection patterns (16 heads; a program's work does not depend on the head count), not refitted.
UNION_PER_HEAD_PAIR_GLUON = 1.36e-12
ABSORBED_UP_TO_16_HEADS, ABSORBED_PER_64_HEADS = 2.65e-10, 3.45e-10


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
    it: late queries at T = 32k put two selections in a word on average (0.58 ms for 67 M selections)."""
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


@triton.jit(do_not_specialize=["T", "L", "n_tiles"])
def _union_attn_fwd(q_ptr, kv_ptr, pe_ptr, mask_ptr, mask_off_ptr, union_ptr, count_ptr, o_ptr, T, L, n_tiles,
                    qk_scale, s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_pb, s_ps, s_ob, s_ot, s_oh,
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
    union, count = union_ptr + (b * n_tiles + tile) * L, tl.load(count_ptr + b * n_tiles + tile)
    # The tile's mask [chunks of 32 slots, BLOCK_M] (_mask_row): a chunk's words are contiguous.
    mask_rows = mask_ptr + tl.load(mask_off_ptr + b * n_tiles + tile) + tl.arange(0, BLOCK_M)
    bit = tl.arange(0, BLOCK_N)[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Positions one chunk ahead, carried by hand: the gathers they address then run a stage ahead (docstring).
    pos_next = tl.load(union + tl.arange(0, BLOCK_N), mask=tl.arange(0, BLOCK_N) < count, other=0)
    for n0 in range(0, count, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < count
        pos = pos_next
        pos_next = tl.load(union + n + BLOCK_N, mask=n + BLOCK_N < count, other=0)
        if OFF64:
            pos = pos.to(tl.int64)
        k = _rows_at(k_row, pos * s_ks, n_ok, DN, BLOCK_DN)  # [BLOCK_N, BLOCK_DN]
        pe = _rows_at(pe_row, pos * s_ps, n_ok, DR, BLOCK_DR)
        v = _rows_at(v_row, pos * s_ks, n_ok, DV, BLOCK_DV)
        s = tl.dot(q_nope, tl.trans(k), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION)
        word = tl.load(mask_rows + (n0 // 32) * BLOCK_M)
        if BLOCK_N < 32:  # BLOCK_N divides 32: this chunk's bits start at bit n0 % 32 of the word
            word = word >> (n0 % 32)
        chosen = ((word[:, None] >> bit) & 1) != 0
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
    each. Again with the bit-row build (the whole op, 79 % / 92 %): 128 x 32 with 3 or 4 stages within the
    run-to-run spread (5.25-5.43 / 3.89-4.33 ms), 5 stages 6.8 / 5.2, 128 x 64 7.5-8.1 / 5.3-6.0, 64 x 64
    6.4 / 5.6. With the word masks and carried positions: 128 x 32, 8 warps, 3 stages 5.2-5.5 / 3.75-3.79;
    64 x 32, 4 warps, 2 stages (three programs per SM) 5.7 / 4.0; 3 stages 5.5-5.7 / 4.1. The interpreter
    costs ~4 ms per program instance and loop step: CPU runs take the smallest tiles."""
    # BLOCK_N <= 32: one int32 mask word per query and chunk.
    if not on_gpu:
        return 16, 16, 4, 1
    if elt >= 4:  # fp32 kv: twice the bytes per row and per register
        return 64, 32, 4, 2
    return 128, 32, 8, 3


def _decompress(kv_latent_plane, k_pe_plane, table, kv_b_weight, B: int, H: int):
    """Every position the given block table reaches (its width x block_size), decompressed, in logical order:
    (kv [B, S, H, dn + dv], k_pe [B, S, dr]) in the weight's dtype. Whole blocks are gathered; a -1 entry
    stands in block 0, whose rows are then never read (no selection there is valid)."""
    blocks = table.clamp(min=0)
    wdt = kv_b_weight.dtype
    latent = kv_latent_plane[blocks].view(B, -1, kv_latent_plane.shape[-1]).to(wdt)  # [B, S, r]
    kv = F.linear(latent, kv_b_weight).view(B, latent.shape[1], H, -1)
    return kv, k_pe_plane[blocks].view(B, -1, k_pe_plane.shape[-1]).to(wdt)


def _fetch_later(t: torch.Tensor):
    """Start copying the small tensor t to the host without waiting -> a function that waits for that copy
    alone, not for the GPU work queued after it, and returns t's values as a list."""
    if t.device.type != "cuda":
        return t.tolist
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))

    def wait() -> list:
        copied.synchronize()
        return host.tolist()
    return wait


def _bitmaps(idx, table, bs: int, B: int, T: int, S: int, on_gpu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(bits int32 [B * T, ceil(S / 32)], n_valid int32 [B * T]): bit p % 32 of word p // 32 of row b * T + t
    is set when query (b, t) selected the valid position p; n_valid counts its valid selections. 4 bytes
    per query and 32 positions: 128 MB at T = S = 32k."""
    K = idx.shape[-1]
    bits = torch.zeros(B * T, triton.cdiv(S, 32), dtype=torch.int32, device=idx.device)
    n_valid = torch.empty(B * T, dtype=torch.int32, device=idx.device)
    # 128 selections per step and 1 warp: 0.58 ms at T = 32k, top-k 2048 on the H200 (256 / 2 warps 0.60,
    # 512 / 4 0.63, 1024 / 4 0.67); the atomics bind it.
    block_k = min(128 if on_gpu else 64, triton.next_power_of_2(K))
    _mark_bits[(B * T,)](idx, table, bits, n_valid, T, K, S, bits.shape[1], table.shape[1], idx.stride(0),
                         idx.stride(1), table.stride(0), BS=bs, BLOCK_K=block_k, num_warps=1)
    return bits, n_valid


def _tile_unions(bits, n_valid, B: int, T: int, S: int, BLOCK_M: int, on_gpu: bool):
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


def _tile_masks(bits, union, count, mask_off, total: int, T: int, BLOCK_M: int, on_gpu: bool) -> torch.Tensor:
    """Each query's selection as bits over its tile's union: int32 [total]. Tile i is [ceil(count[i] / 32),
    BLOCK_M] at mask_off[i]; bit j of word (c, m) is set where query m of the tile selected union slot c *
    32 + j. Zeros past count and past T let the attention loop load every chunk without bounds."""
    B, n_tiles, L = union.shape
    mask = torch.empty(max(1, total), dtype=torch.int32, device=bits.device)  # every word is written
    _mask_row[(B * n_tiles * BLOCK_M,)](bits, union, count, mask, mask_off, T, bits.shape[1], L, n_tiles,
                                       BLOCK_M=BLOCK_M, BLOCK_R=1024 if on_gpu else 64, num_warps=4 if on_gpu else 1)
    return mask


def _gluon_attends(q, kv, k_pe, dn: int, scale: float, BLOCK_M: int) -> bool:
    """Whether _attend runs the sm_90 Gluon kernel (mla_prefill_gluon.py), which reads 128-query tiles."""
    return (USE_GLUON and _gluon is not None and BLOCK_M == int(_gluon.BLOCK_M)
            and _gluon.gluon_fits(q, kv, k_pe, dn, scale * _LOG2E))


def _attend(q, kv, k_pe, union, count, mask, mask_off, out, dn: int, scale: float, BLOCK_M: int, BLOCK_N: int,
            num_warps: int, num_stages: int, gluon: bool) -> None:
    """Launch _union_attn_fwd (or, with ``gluon`` = _gluon_attends(...), the Gluon kernel): q [B, T, H, dn+dr],
    kv [B, S, H, dn+dv], k_pe [B, S, dr] -> out [B, T, H, dv]."""
    if gluon:
        _gluon.attend(q, kv, k_pe, union, count, mask, mask_off, out, dn, scale * _LOG2E)
        return
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


def union_break_even(heads: int, gluon: bool = False) -> float:
    """(query, union slot) pairs per (query, selected position) pair below which the union form is faster
    (the cost model above): 9.7 at 16 heads, 6.2 at 32, 3.0 at 64, 4.1 at 96 with this file's kernel; 11.4,
    7.4, 3.5 and 4.9 with the Gluon kernel (``gluon``). Below 16 heads, unmeasured, it stays at the 16-head
    value rather than extrapolate the union form's per-head cost."""
    h = max(heads, 16)
    absorbed = ABSORBED_UP_TO_16_HEADS if heads <= 16 else ABSORBED_PER_64_HEADS * triton.cdiv(heads, 64)
    per_pair = UNION_PER_HEAD_PAIR_GLUON if gluon else UNION_PER_HEAD_PAIR
    return (absorbed - UNION_FIXED[0] - UNION_FIXED[1] * h) / (per_pair * h)


def use_union_form(union_pairs: float, selected: int, heads: int = 16, gluon: bool = False) -> bool:
    """Whether the union form is expected to beat the absorbed form: FORM, or for "auto" the ratio of
    (query, union slot) pairs to (query, selected position) pairs against union_break_even(heads, gluon)."""
    if FORM not in ("auto", "union", "absorbed"):
        raise ValueError(f"mla_prefill_triton.FORM is {FORM!r}; use 'auto', 'union' or 'absorbed'")
    if FORM != "auto":
        return FORM == "union"
    return union_pairs < union_break_even(heads, gluon) * selected


def sparse_mla_prefill(q: torch.Tensor, kv_latent_plane: torch.Tensor, k_pe_plane: torch.Tensor,
                       block_table: torch.Tensor, indices: torch.Tensor, kv_b_weight: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Sparse MLA prefill: the contract, shapes and dtypes of ``sparse_mla_prefill_ref``. Masked attention
    over each query tile's union of selected positions, or the absorbed per-query form when the unions are
    too large for that to pay (see the module docstring)."""
    B, T, H, dn, dv = check_prefill_args(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight)
    args = (q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale)
    if torch.float64 in (q.dtype, kv_latent_plane.dtype, k_pe_plane.dtype, kv_b_weight.dtype):
        return sparse_mla_prefill_ref(*args)
    if B * T == 0 or indices.shape[-1] == 0 or FORM == "absorbed":
        return sparse_mla_prefill_absorbed(*args)
    bs, on_gpu = kv_latent_plane.shape[1], q.device.type == "cuda"
    BLOCK_M, BLOCK_N, num_warps, num_stages = _blocks(on_gpu, kv_b_weight.element_size())
    idx, table = indices.to(torch.int32), block_table.to(torch.int32)
    # S bounds every position the op marks, ORs and decompresses. A table that reaches at most twice the
    # prompt (a prefill without a long prefix) sets it, with no host sync before the union build. A wider
    # one (a long prefix, or a table made for a longer sequence: 128k positions for a 1k prompt) costs a
    # sync for the highest selection instead, so that the work follows the selections and not the table.
    # H200, T = 32k, where both give S = T: that sync took 0.2-0.3 ms more per call (4.8-5.1 ms against
    # 4.6-4.9 at 79 % overlap, 3.6 against 3.3 at 92 %): the GPU drains while the host waits.
    reach = table.shape[1] * bs
    S = reach if reach <= 2 * T else min(int(idx.max()) + 1, reach)
    if S <= 0:  # no block, or nothing selected anywhere: the absorbed form returns zeros
        return sparse_mla_prefill_absorbed(*args)
    bits, n_valid = _bitmaps(idx, table, bs, B, T, S, on_gpu)
    union, count, mask_off, stats = _tile_unions(bits, n_valid, B, T, S, BLOCK_M, on_gpu)
    work = _fetch_later(stats)
    # Queued before the host waits for the counts: the GPU decompresses (0.2 ms at T = 32k) while the host
    # wakes up and launches the masks (wasted when the absorbed form wins).
    kv, k_pe = _decompress(kv_latent_plane, k_pe_plane, table[:, :triton.cdiv(S, bs)], kv_b_weight, B, H)
    q = q if q.stride(-1) == 1 else q.contiguous()
    pairs, selected, total = work()  # waits for the counts' copy alone
    gluon = _gluon_attends(q, kv, k_pe, dn, scale, BLOCK_M)  # the union kernel that would run sets its cost
    if not use_union_form(pairs, selected, H, gluon):
        return sparse_mla_prefill_absorbed(*args)
    mask = _tile_masks(bits, union, count, mask_off, total, T, BLOCK_M, on_gpu)
    del bits  # 4 bytes per query and 32 positions, no longer needed: free them before attention runs
    out = torch.empty(B, T, H, dv, dtype=torch.float32, device=q.device)
    _attend(q, kv, k_pe, union, count, mask, mask_off, out, dn, scale, BLOCK_M, BLOCK_N, num_warps, num_stages,
            gluon)
    return out
