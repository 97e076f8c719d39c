"""Triton kernel for sparse MLA attention over the paged latent cache: decode, and the absorbed form of prefill.

Same contracts and signatures as ``reference.sparse_mla_decode_ref`` / ``sparse_mla_prefill_ref`` (docs/design.md
§4, §12). Both ops run one kernel, ``_latent_attn_fwd``: the attention of each query's H heads over exactly its K
selected latent rows, in the absorbed (MQA) form

    score[h, s] = (q_latent[h] . c_kv[s] + q_pe[h] . k_pe[s]) * scale,    o_latent[h] = sum_s p[h, s] c_kv[s]

where c_kv [r] is both key (with k_pe [dr] appended) and value. The selected positions are turned into plane row
numbers once per call before it (latent_rows_triton.py), so the loop reads one int32 per gathered row.

Grid and tiling. One program per (query (b, t), block of BLOCK_H heads, split of the K positions).
All heads of a query share the same K rows (one top-k set per query, MQA), so the heads are the M
dimension of both tl.dot calls: each gathered row is loaded once and used by BLOCK_H heads. Heads
are padded to BLOCK_H >= 16 (tl.dot's minimum) with masks; padded heads load q = 0, and are never
stored. The program walks its positions BLOCK_N at a time:

    row  = rows[b, t, n0:n0+BLOCK_N]                        (int32, -1 = invalid)
    ptr  = plane + row * plane row stride, or the zero row where row = -1
    kv   = kv_latent[ptr, :r]  [BLOCK_N, BLOCK_R],  pe = k_pe[ptr, :dr]  [BLOCK_N, BLOCK_DR]
    s    = q @ kv^T + q_pe @ pe^T                           [BLOCK_H, BLOCK_N]   (-inf where invalid)
    online softmax (fp32, base 2), acc = acc * alpha + p @ kv   [BLOCK_H, BLOCK_R]

Memory access. A gathered row is one contiguous vector per plane (r then dr values), so each load
is BLOCK_N coalesced row reads (16-byte asynchronous copies), with no torch gather beforehand. One load
per row serves as key (a transposed view) and as value: the tile is read once. Rows of consecutive
cache blocks are consecutive in the planes the cache allocates, so a row number times the row stride
addresses both planes (other layouts are copied first). An invalid position (padding, a missing block,
the tail of the last chunk) reads the zero row that the row-number pass writes, never the plane: the
loads need no mask, and an unselected plane row that holds a NaN cannot reach the output
(docs/design.md §10 trap 4; 0 * NaN would). Invalid columns get score -inf and probability 0; a query
with no valid position keeps l = 0 and gets zeros, like the reference. Row offsets are int32 for
planes under 2^31 elements (half the address arithmetic of int64).

Split (flash-decoding). Decode has only B*T queries: B = 32, H = 96 gives 64 programs for 132 SMs.
The K positions are then cut into NUM_SPLITS fixed, equal ranges (a multiple of BLOCK_N) so that the
grid fills about one wave (register use allows one program per SM); each program writes its
unnormalised acc and its (m, l), and ``_combine_splits`` (one program per query and head) merges them
in split order: o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s. Fixed ranges and no atomics make
the result bitwise deterministic. Prefill has B*T >> SMs and never splits.

Precision. Accumulation and softmax are fp32. With bf16/fp16 planes, q and p are cast to the plane
dtype for tl.dot (tensor cores; the reference rounds the same rows to bf16 in the cache). With fp32
planes the dots run with input_precision="ieee" (no TF32), so fp32 results agree with the reference
to ~1e-6. fp64 inputs (exactness tests only) are passed to the reference.

Absorbed prefill (``sparse_mla_prefill_absorbed``). The wrapper folds W_UK into q (q_latent[h] =
q_nope[h] @ W_UK[h], one batched matmul over heads), runs the decode kernel over every query (M = the H
heads of one query), and applies W_UV after (o[h] = o_latent[h] @ W_UV[h]^T). Per query this costs
2*H*K*(2r + dr) FLOPs and K*(r + dr) gathered cache values, however much the selections of neighbouring
queries overlap. The prefill op (prefill_triton.py) runs this form when the query tiles' unions of
selected positions are too large for its union form (prefill_form.py): for top-2048 picks spread over a
long prefix a 64-position block is missed by one query with probability (1 - 2048/p)^64 (0.016 at
p = 32k), so a union of blocks is nearly the whole prefix.

What binds it: not memory. Decode is bound by latency at one program per SM (the [BLOCK_H, r] fp32
accumulator fills the registers) and by the score dots, which the compiler gives both warp groups (a dot
that feeds another dot gets all its warps along M); the absorbed prefill by gathering K rows per query.
On sm_90 the op's Gluon form (sm90_gluon.py) hands ``_latent_attention`` latent_gluon.py, which takes the calls
it fits: a producer warp group gathers and two compute groups split the work explicitly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .._pdl import launch_options, use_pdl
from .latent_rows_triton import row_plane, rows_and_zero_row
from .reference import check_decode_args, check_prefill_args, sparse_mla_decode_ref, sparse_mla_prefill_ref

LOG2E = 1.4426950408889634
# Planes with fewer elements than this are addressed with int32 row offsets (half the address arithmetic);
# larger ones with int64.
INT32_OFFSETS_BELOW = 2**31
# On sm_90 and later, the Gluon kernel and the split combine are launched as programmatic dependents of the kernel
# before them (ops/_pdl.py): each starts while that one finishes, and waits (griddepcontrol.wait) before it reads
# what that kernel wrote.


@triton.jit
def _chunk_ptrs(rows_ptr, n0, end, kv_ptr, pe_ptr, zero_ptr, s_kv, s_pe, BLOCK_N: tl.constexpr,
                OFF64: tl.constexpr):
    """Positions n0 .. n0+BLOCK_N of one query -> (valid [BLOCK_N], row pointers into both planes).

    An invalid position (row -1, or past ``end``) points at the zero row: every gathered load is then
    unmasked (no predicate per 16-byte copy), and a zero row gives p * 0 = 0 in the value sum where
    an arbitrary row could hold a NaN (docs/design.md §10 trap 4); its score is set to -inf anyway.
    Row offsets are int32 for planes under 2^31 elements (half the address arithmetic), else int64."""
    n = n0 + tl.arange(0, BLOCK_N)
    r = tl.load(rows_ptr + n, mask=n < end, other=-1)
    valid = r >= 0
    if OFF64:  # a large cache passes 2^31 elements
        r = r.to(tl.int64)
    return valid, tl.where(valid, kv_ptr + r * s_kv, zero_ptr), tl.where(valid, pe_ptr + r * s_pe, zero_ptr)


@triton.jit
def _gather(ptrs, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """Rows [BLOCK_N, BLOCK_W] at row pointers ``ptrs`` (columns past W are 0). The column mask exists
    only for widths that are not a power of two: without a mask the compiler issues 16-byte vector
    loads (asynchronous copies) for the gathered rows."""
    cols = tl.arange(0, BLOCK_W)
    if W == BLOCK_W:
        return tl.load(ptrs[:, None] + cols[None, :])
    return tl.load(ptrs[:, None] + cols[None, :], mask=(cols < W)[None, :], other=0.0)


@triton.jit
def rows_at(ptr, offs, ok, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """Rows [len(offs), BLOCK_W] at element offsets ``offs``: 0 where ``ok`` is False (padded heads, rows
    past the end) and in columns past W. The query block of the decode loop; the prefill kernel's q, k, v."""
    cols = tl.arange(0, BLOCK_W)
    return tl.load(ptr + offs[:, None] + cols[None, :], mask=ok[:, None] & (cols < W)[None, :], other=0.0)


@triton.jit
def softmax_step(s, m_i, l_i):
    """One online-softmax update on log2-scaled scores s [BLOCK_H, BLOCK_N] (-inf = invalid column).

    While a head has seen no valid key its max is -inf; the reference point m_safe = 0 then keeps every
    exponent finite (2^-inf = 0) instead of producing -inf - -inf. Returns (p, alpha, m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend_selected(q_ptr, qpe_ptr, kv_ptr, pe_ptr, zero_ptr, rows_ptr, hoff, head_ok, start, end, qk_scale,
                     s_qh, s_ph, s_kv, s_pe, R: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, OFF64: tl.constexpr):
    """The loop over the selected positions, heads as the dots' M: s = q @ kv^T [BLOCK_H, BLOCK_N] and
    acc += p @ kv. Returns (acc [BLOCK_H, BLOCK_R], m [BLOCK_H], l [BLOCK_H])."""
    dot_dtype = kv_ptr.dtype.element_ty  # bf16 planes -> bf16 tensor-core dots; fp32 -> ieee fp32
    # The query block is loaded once (padded heads: q = 0, never stored); on Hopper the compiler keeps it
    # in shared memory, where the score wgmma reads it.
    q = rows_at(q_ptr, hoff * s_qh, head_ok, R, BLOCK_R).to(dot_dtype)
    qpe = rows_at(qpe_ptr, hoff * s_ph, head_ok, DR, BLOCK_DR).to(dot_dtype)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of log2-scaled scores
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of 2^(s - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        valid, kv_rows, pe_rows = _chunk_ptrs(rows_ptr, n0, end, kv_ptr, pe_ptr, zero_ptr, s_kv, s_pe, BLOCK_N,
                                              OFF64)
        # One load per row serves as key (transposed view) and as value: the tile is read once.
        kv = _gather(kv_rows, R, BLOCK_R)  # [BLOCK_N, BLOCK_R]
        pe = _gather(pe_rows, DR, BLOCK_DR).to(dot_dtype)  # [BLOCK_N, BLOCK_DR]
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.dot(qpe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # qk_scale = scale * log2(e)
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        acc = tl.dot(p.to(dot_dtype), kv, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _latent_attn_fwd(
    q_ptr, qpe_ptr, kv_ptr, pe_ptr, zero_ptr, rows_ptr, o_ptr, m_ptr, l_ptr,
    T, H, K, keys_per_split, qk_scale,
    s_qb, s_qt, s_qh, s_pb, s_pt, s_ph,  # q_latent / q_pe strides (last dim contiguous)
    s_kv, s_pe,  # plane row strides (rows of consecutive blocks are consecutive: see _latent_attention)
    s_ob, s_ot, s_os, s_oh,  # output (or partial acc) strides: b, t, split, head
    s_mbt, s_ms,  # m / l partials [B*T, NUM_SPLITS, H] (only used when NUM_SPLITS > 1)
    R: tl.constexpr, DR: tl.constexpr,  # compile-time widths: a full-width row needs no column mask
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, OFF64: tl.constexpr,
):
    bt = tl.program_id(0).to(tl.int64)  # int64 offsets: a long prefill's [H, B*T, r] output passes 2^31
    b, t, split = bt // T, bt % T, tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    hoff = heads.to(tl.int64)  # head offsets in the head-major prefill layout are large too
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, K)
    q_row, qpe_row = q_ptr + b * s_qb + t * s_qt, qpe_ptr + b * s_pb + t * s_pt
    acc, m_i, l_i = _attend_selected(q_row, qpe_row, kv_ptr, pe_ptr, zero_ptr, rows_ptr + bt * K, hoff, head_ok,
                                     start, end, qk_scale, s_qh, s_ph, s_kv, s_pe, R, DR, BLOCK_H, BLOCK_N,
                                     BLOCK_R, BLOCK_DR, DOT_PRECISION, OFF64)
    cols_r = tl.arange(0, BLOCK_R)
    o_ptrs = o_ptr + b * s_ob + t * s_ot + split * s_os + hoff[:, None] * s_oh + cols_r[None, :]
    out_mask = head_ok[:, None] & (cols_r < R)[None, :]
    if NUM_SPLITS == 1:  # empty rows (l = 0, acc = 0) divide by 1 and stay zero
        tl.store(o_ptrs, (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(o_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(o_ptrs, acc, mask=out_mask)
        tl.store(m_ptr + bt * s_mbt + split * s_ms + heads, m_i, mask=head_ok)
        tl.store(l_ptr + bt * s_mbt + split * s_ms + heads, l_i, mask=head_ok)


@triton.jit
def _combine_splits(acc_ptr, m_ptr, l_ptr, o_ptr, H, R,
                    s_abt, s_as, s_ah, s_mbt, s_ms, s_obt, s_oh,
                    BLOCK_R: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One (query, head): o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, splits in a fixed order."""
    if PDL:  # launched as a dependent of the attention kernel: its partials are complete after this
        gdc_wait()
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK_R)
    mask = cols < R
    m_all = float("-inf")
    for s in tl.static_range(NUM_SPLITS):
        m_all = tl.maximum(m_all, tl.load(m_ptr + bt * s_mbt + s * s_ms + h))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)  # empty row: every weight is 2^-inf = 0
    num = tl.zeros([BLOCK_R], tl.float32)
    den = 0.0
    for s in tl.static_range(NUM_SPLITS):
        w = tl.exp2(tl.load(m_ptr + bt * s_mbt + s * s_ms + h) - m_safe)
        den += w * tl.load(l_ptr + bt * s_mbt + s * s_ms + h)
        num += w * tl.load(acc_ptr + bt * s_abt + s * s_as + h * s_ah + cols, mask=mask, other=0.0)
    o = num / tl.where(den > 0, den, 1.0)
    tl.store(o_ptr + bt * s_obt + h * s_oh + cols, o.to(o_ptr.dtype.element_ty), mask=mask)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a tiny nominal machine, so tests exercise the split path on small inputs


def _config(H: int, R: int, K: int, queries: int, device: torch.device, num_splits: int | None, elt: int):
    """Tile sizes and split count for the kernel (``elt``: bytes per plane element) -> (BLOCK_H, BLOCK_N,
    NUM_SPLITS, num_warps, num_stages). Registers are the limit: the [BLOCK_H, r] fp32 accumulator lives in
    them, while the query is a shared-memory operand of the score wgmma. The H200 sweeps behind these choices
    (r=512, dr=64, bf16) are in docs/benchmarks.md, "Decode: Triton tile sweep" and "Absorbed prefill (latent
    kernel over every query)"."""
    BLOCK_H = min(64, max(16, triton.next_power_of_2(H)))
    BLOCK_R = max(16, triton.next_power_of_2(R))
    if BLOCK_H == 16:
        BLOCK_N, num_warps = 128, 4  # one mma row block: long chunks keep enough bytes in flight
    else:
        BLOCK_N, num_warps = 64, 8
    if elt >= 4:  # fp32 planes (tests, fp32 models): twice the bytes per row and per register
        BLOCK_H, BLOCK_N = min(BLOCK_H, 32), min(BLOCK_N, 32)
    # A gathered tile is staged in shared memory (two stages): keep it at most 128 KB.
    while BLOCK_N > 16 and BLOCK_N * BLOCK_R * elt > 128 * 1024:
        BLOCK_N //= 2
    if num_splits is None:
        # About one wave: one program per SM (register use allows no more), and never a split shorter
        # than two chunks. Prefill (queries >> SMs) never splits.
        programs = queries * triton.cdiv(H, BLOCK_H)
        num_splits = max(1, min(_num_sms(device) // programs, K // (2 * BLOCK_N), 16))
    # Short ranges (tiny K, or many splits) use a smaller chunk so that padding the last one wastes less.
    BLOCK_N = min(BLOCK_N, max(16, triton.next_power_of_2(triton.cdiv(K, num_splits))))
    return BLOCK_H, BLOCK_N, num_splits, num_warps, 2


def _combine(part, m, lse, out, H: int, R: int, st: int, sh: int, BLOCK_R: int, splits: int, pdl: bool) -> None:
    """Launch _combine_splits: partials [B*T, splits, H, R] -> out (b, t dims merged: stride st per query)."""
    _combine_splits[(part.shape[0], H)](
        part, m, lse, out, H, R, part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1), st, sh,
        BLOCK_R=BLOCK_R, NUM_SPLITS=splits, PDL=pdl, num_warps=4, **launch_options(pdl))


def _latent_attention(q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices, scale, out,
                      out_strides, num_splits=None, gluon=None):
    """Launch the kernels. q_latent [B,T,H,r], q_pe [B,T,H,dr] (any strides, last dim contiguous),
    ``out`` written through ``out_strides`` = (b, t, h) element strides -> out holds o_latent. ``gluon``: the
    sm_90 module (latent_gluon.py), which takes the attention where it fits the call; None: this file's kernel."""
    B, T, H, R = q_latent.shape
    DR = q_pe.shape[-1]
    K = indices.shape[-1]
    nblocks, bs, _ = kv_latent_plane.shape
    if nblocks * bs >= 2**31:
        raise ValueError(f"a cache of {nblocks} blocks x {bs} rows passes 2^31 rows; the row numbers are int32")
    kv_plane, s_kv = row_plane(kv_latent_plane)
    pe_plane, s_pe = row_plane(k_pe_plane)
    dev = q_latent.device
    elt = kv_plane.element_size()
    BLOCK_H, BLOCK_N, splits, num_warps, num_stages = _config(H, R, K, B * T, dev, num_splits, elt)
    gluon = gluon if gluon is not None and gluon.gluon_fits(kv_plane, pe_plane, H) else None
    BLOCK_R, BLOCK_DR = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(DR))
    rows, zero = rows_and_zero_row(block_table, indices, B, T, K, bs, max(BLOCK_R, BLOCK_DR) * elt, dev.type == "cuda")
    tile_h, tile_n = (int(gluon.BLOCK_H), int(gluon.BLOCK_N)) if gluon is not None else (BLOCK_H, BLOCK_N)
    keys_per_split = triton.cdiv(triton.cdiv(K, splits), tile_n) * tile_n  # whole tiles per split
    grid = (B * T, triton.cdiv(H, tile_h), splits)
    common = (q_latent, q_pe, kv_plane, pe_plane, zero.view(kv_plane.dtype), rows)
    sizes = (T, H, K, keys_per_split, float(scale) * LOG2E,
             q_latent.stride(0), q_latent.stride(1), q_latent.stride(2), q_pe.stride(0), q_pe.stride(1),
             q_pe.stride(2), s_kv, s_pe)
    precision = "ieee" if kv_plane.dtype == torch.float32 else "tf32"  # "tf32" is ignored for bf16
    meta = dict(R=R, DR=DR, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, BLOCK_DR=BLOCK_DR, NUM_SPLITS=splits,
                DOT_PRECISION=precision, OFF64=max(kv_plane.numel(), pe_plane.numel()) >= INT32_OFFSETS_BELOW,
                num_warps=num_warps, num_stages=num_stages)

    pdl = use_pdl(dev)

    def attend(o, m, lse, o_strides, ml_strides):
        if gluon is not None:
            gluon.launch(grid, *common, o, m, lse, sizes, o_strides, ml_strides, R, DR, splits, pdl)
        else:
            _latent_attn_fwd[grid](*common, o, m, lse, *sizes, *o_strides, *ml_strides, **meta)

    sb, st, sh = out_strides
    if splits == 1:
        return attend(out, out, out, (sb, st, 0, sh), (0, 0))
    part = torch.empty(B * T, splits, H, R, dtype=torch.float32, device=dev)
    m = torch.empty(B * T, splits, H, dtype=torch.float32, device=dev)
    lse = torch.empty_like(m)
    attend(part, m, lse, (T * part.stride(0), part.stride(0), part.stride(1), part.stride(2)),
           (m.stride(0), m.stride(1)))
    if sb != T * st:
        raise ValueError("split decode needs an output whose (b, t) dims merge")  # never with our callers
    _combine(part, m, lse, out, H, R, st, sh, BLOCK_R, splits, pdl)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def sparse_mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_latent_plane: torch.Tensor,
                      k_pe_plane: torch.Tensor, block_table: torch.Tensor, indices: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Absorbed sparse MLA attention over exactly the selected latent rows: the contract, shapes and
    dtypes of ``sparse_mla_decode_ref``; the row-number pass, one attention launch, and a combine when the
    K positions are split."""
    return latent_decode(q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices, scale)


def latent_decode(q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices, scale, gluon=None):
    """``sparse_mla_decode``, its attention on the sm_90 module ``gluon`` (latent_gluon.py) where that fits."""
    B, T, H, r, _, _ = check_decode_args(q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices)
    if torch.float64 in (q_latent.dtype, q_pe.dtype, kv_latent_plane.dtype, k_pe_plane.dtype):
        # fp64 exists for exactness tests; tensor cores do not do it, the reference does.
        return sparse_mla_decode_ref(q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices, scale)
    # Every element is written by the kernels (an empty row gets zeros there), so no memset launch.
    out = torch.empty(B, T, H, r, dtype=torch.float32, device=q_latent.device)
    if out.numel() == 0 or indices.shape[-1] == 0:
        return out.zero_()  # no query, or nothing selected: zeros like the reference
    _latent_attention(_last_dim_contiguous(q_latent), _last_dim_contiguous(q_pe), kv_latent_plane, k_pe_plane,
                      block_table.to(torch.int32), _last_dim_contiguous(indices.to(torch.int32)),
                      scale, out, (out.stride(0), out.stride(1), out.stride(2)), gluon=gluon)
    return out


def sparse_mla_prefill_absorbed(q: torch.Tensor, kv_latent_plane: torch.Tensor, k_pe_plane: torch.Tensor,
                                block_table: torch.Tensor, indices: torch.Tensor, kv_b_weight: torch.Tensor,
                                scale: float, *, gluon=None) -> torch.Tensor:
    """Sparse MLA prefill: the contract, shapes and dtypes of ``sparse_mla_prefill_ref``, computed in the
    absorbed form (see the module docstring): W_UK folded into q, the latent kernel, W_UV after. The op
    (prefill_triton.sparse_mla_prefill) runs this form when the query tiles' unions are large. ``gluon``: as
    for ``latent_decode``."""
    B, T, H, dn, dv = check_prefill_args(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight)
    r = kv_latent_plane.shape[-1]
    if torch.float64 in (q.dtype, kv_latent_plane.dtype, k_pe_plane.dtype, kv_b_weight.dtype):
        return sparse_mla_prefill_ref(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale)
    if B * T == 0 or indices.shape[-1] == 0:
        return torch.zeros(B, T, H, dv, dtype=torch.float32, device=q.device)
    # The matmuls run in the weight's dtype (the model's compute dtype), like the reference's
    # decompression: bf16 tensor cores with fp32 accumulation in a bf16 model, fp32 in an fp32 one.
    wdt = kv_b_weight.dtype
    w = kv_b_weight.view(H, dn + dv, r)
    w_uk, w_uv = w[:, :dn], w[:, dn:]  # [H, dn, r], [H, dv, r]
    # Head-major layouts [H, B*T, .] make both absorptions plain batched matmuls over heads.
    q_nope = q[..., :dn].to(wdt).reshape(B * T, H, dn).transpose(0, 1)  # [H, BT, dn]
    q_latent = torch.bmm(q_nope, w_uk)  # [H, BT, r]
    q_pe = q[..., dn:]  # [B, T, H, dr], read in place by the kernel
    # o_latent is written straight in the weight dtype, head-major, ready for the W_UV matmul.
    o_latent = torch.empty(H, B * T, r, dtype=wdt, device=q.device)
    hs, ts = q_latent.stride(0), q_latent.stride(1)
    q_lat_view = q_latent.as_strided((B, T, H, r), (T * ts, ts, hs, 1))
    _latent_attention(q_lat_view, _last_dim_contiguous(q_pe), kv_latent_plane, k_pe_plane,
                      block_table.to(torch.int32),
                      _last_dim_contiguous(indices.to(torch.int32)), scale, o_latent,
                      (T * o_latent.stride(1), o_latent.stride(1), o_latent.stride(0)), num_splits=1, gluon=gluon)
    o = torch.bmm(o_latent, w_uv.transpose(1, 2))  # [H, BT, dv]
    return o.transpose(0, 1).reshape(B, T, H, dv).float()
