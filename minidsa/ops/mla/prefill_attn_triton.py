"""The union attention of the sparse MLA prefill's union form (prefill_triton.py): FlashAttention in decompressed
(MHA) form over each query tile's union of selected positions, masked by each query's own selection.

Inputs (built by prefill_triton.py and prefill_union_triton.py): q [B, T, H, dn + dr]; the decompressed kv
[B, S, H, dn + dv] and k_pe [B, S, dr] (one vector per position, shared by the heads); per tile of BLOCK_M
queries the sorted union list, its count, and the chunk-major bit mask at mask_off[tile]. Output [B, T, H, dv]
fp32.

``_union_attn_fwd``, one program per (head, tile, sequence), walks the tile's union BLOCK_N slots at a time:

    pos  = union[n0 : n0 + BLOCK_N]                       gathered rows of this head's k, v
    s    = q_nope @ k_nope[pos]^T + q_pe @ k_pe[pos]^T     [BLOCK_M, BLOCK_N]
    s    = -inf where mask[query, slot] = 0
    online softmax (fp32, base 2);  acc = acc * alpha + p @ v[pos]

Tiling and memory access. A gathered position is one row of dn (or dv) values of one head, as a block's
position would be. BLOCK_N <= 32 slots, so a query's bits of one chunk sit in one int32 mask word; a chunk's
BLOCK_M words are contiguous (chunk-major mask). The mask words are padded (zeros past count and past T), so
their loads need no bounds, and they are loaded in the iteration, where the pipeliner stages them like the k,
v rows: a mask loaded by hand one iteration ahead keeps its load layout, and the compiler then runs the
softmax twice. The positions of the next chunk, though, are loaded by hand one iteration ahead: loaded in the
iteration, they make the pipeliner issue each chunk's gathers only one iteration ahead and wait for every copy
at the top of the loop; carried, the gathers run a stage ahead. Two programs must share an SM to hide the
latencies that remain: 128 x 32 tiles, 8 warps and three stages take 111.6 KB of shared memory with the word
masks and fit twice (byte masks or a fourth stage do not). Heads vary fastest in the grid: the H programs of a
tile run together and share its list and mask in L2; the last tiles (longest unions) start first.

Masks and padding: a query with no valid position keeps l = 0 and gets zeros, like the reference. A row of the
union that one query of the tile selected is read for every query of the tile (with p = 0 for the others), so
a NaN stored in that row reaches the whole tile; rows no query of the tile selected are never read.

Precision: fp32 accumulation and softmax; bf16/fp16 kv gives tensor-core dots on q and p cast to that dtype;
fp32 kv runs input_precision="ieee" (no TF32). Row offsets are int32 below 2^31 elements, else int64.

What binds it: the dots and the softmax at two programs per SM (about half of the bf16 tensor-core peak), not
memory traffic. The op's sm_90 form (sm90_gluon.py) has ``attend`` run prefill_gluon.py instead where it fits
(``gluon_attends``: bf16/fp16, dn = dv, 128-query tiles): the same math with a producer warp group for the
gathers and the query in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .latent_triton import INT32_OFFSETS_BELOW, LOG2E, rows_at, softmax_step


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
    q_nope = rows_at(q_row, rows * s_qt, row_ok, DN, BLOCK_DN).to(dot_dtype)
    q_pe = rows_at(q_row + DN, rows * s_qt, row_ok, DR, BLOCK_DR).to(dot_dtype)
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
        k = rows_at(k_row, pos * s_ks, n_ok, DN, BLOCK_DN)  # [BLOCK_N, BLOCK_DN]
        pe = rows_at(pe_row, pos * s_ps, n_ok, DR, BLOCK_DR)
        v = rows_at(v_row, pos * s_ks, n_ok, DV, BLOCK_DV)
        s = tl.dot(q_nope, tl.trans(k), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION)
        word = tl.load(mask_rows + (n0 // 32) * BLOCK_M)
        if BLOCK_N < 32:  # BLOCK_N divides 32: this chunk's bits start at bit n0 % 32 of the word
            word = word >> (n0 % 32)
        chosen = ((word[:, None] >> bit) & 1) != 0
        s = tl.where(chosen, s * qk_scale, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)  # the decode kernel's online-softmax step
        acc = tl.dot(p.to(dot_dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    cols = tl.arange(0, BLOCK_DV)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a query with nothing selected: acc = 0, stays 0
    tl.store(o_ptr + b * s_ob + rows[:, None] * s_ot + h * s_oh + cols[None, :], o,
             mask=row_ok[:, None] & (cols < DV)[None, :])


def tile_config(on_gpu: bool, elt: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the union attention, which the union build follows (its tiles
    of BLOCK_M queries): 128 x 32, 8 warps, 3 stages for 16-bit kv on a GPU, the fastest on the H200 (the sweeps:
    docs/benchmarks.md, "Prefill: Triton union attention tile sweep"). The interpreter costs ~4 ms per program
    instance and loop step: CPU runs take the smallest tiles."""
    # BLOCK_N <= 32: one int32 mask word per query and chunk.
    if not on_gpu:
        return 16, 16, 4, 1
    if elt >= 4:  # fp32 kv: twice the bytes per row and per register
        return 64, 32, 4, 2
    return 128, 32, 8, 3


def gluon_attends(gluon, q, kv, k_pe, dn: int, scale: float, BLOCK_M: int):
    """``gluon`` (the sm_90 module prefill_gluon.py, or None) if ``attend`` may hand it this call (it reads
    128-query tiles), else None."""
    fits = gluon is not None and BLOCK_M == int(gluon.BLOCK_M) and gluon.gluon_fits(q, kv, k_pe, dn, scale * LOG2E)
    return gluon if fits else None


def attend(q, kv, k_pe, union, count, mask, mask_off, out, dn: int, scale: float, BLOCK_M: int, BLOCK_N: int,
           num_warps: int, num_stages: int, gluon=None) -> None:
    """Launch _union_attn_fwd (or, with ``gluon`` = gluon_attends(...), the Gluon kernel): q [B, T, H, dn+dr],
    kv [B, S, H, dn+dv], k_pe [B, S, dr] -> out [B, T, H, dv]."""
    if gluon is not None:
        gluon.attend(q, kv, k_pe, union, count, mask, mask_off, out, dn, scale * LOG2E)
        return
    B, T, H, dq = q.shape
    dr, dv, n_tiles = dq - dn, out.shape[-1], union.shape[1]
    _union_attn_fwd[(H, n_tiles, B)](
        q, kv, k_pe, mask, mask_off, union, count, out, T, union.shape[-1], n_tiles, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), k_pe.stride(0),
        k_pe.stride(1), out.stride(0), out.stride(1), out.stride(2),
        DN=dn, DR=dr, DV=dv, BLOCK_DN=max(16, triton.next_power_of_2(dn)),
        BLOCK_DR=max(16, triton.next_power_of_2(dr)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT_PRECISION="ieee" if kv.element_size() >= 4 else "tf32",
        OFF64=max(q.numel(), kv.numel(), out.numel()) >= INT32_OFFSETS_BELOW,  # the decode kernel's limit
        num_warps=num_warps, num_stages=num_stages)
