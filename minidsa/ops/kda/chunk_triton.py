"""Triton kernels of Kimi Delta Attention's chunked WY/UT form, ``kda_chunk`` (the prefill path).

Same signature, layouts and results as ``kda_chunk_ref`` in ``minidsa/ops/kda/reference.py``
(docs/design.md §5, §12), and equal to ``kda_recurrent`` up to rounding: q, k [B, T, H, K]; v [B, T,
HV, V] with HV a multiple of H (value head j reads q/k head j // (HV/H)); g [B, T, HV, K] log-decay;
beta [B, T, HV]; state [B, HV, K, V] fp32. Every kernel computes in fp32 and the op returns a NEW fp32
state: the caller's ``initial_state`` is only read (None means zeros). fp64 inputs (exactness tests
only) go to the reference. No atomics: every output element is written by exactly one program, so
results are bitwise reproducible.

Five kernels, the formulas of ``kda_chunk_ref``'s docstring. The sequence is cut into chunks of
C = min(chunk_size, 64) tokens (the result does not depend on C); a chunk is a tile of BC rows (C
rounded up to a power of two, at least 16 for ``tl.dot``). Rows past C or past T are padding: their
loads are masked to k = q = v = beta = g = 0, steps that leave the state unchanged, exactly as the
reference pads the tail, and their outputs are never stored. Intermediate results go to scratch
tensors in a padded, head-major layout ``[B*HV, NT*BC, width]`` so later kernels read whole chunks
without masks.

1. ``_chunk_decay_kernel``, per (chunk, head): G = cumsum(g) inside the chunk (fp32), stored, plus the
   per-token operands that need only G: Qg = exp(G) * scale * q, Kd = exp(G_C - G) * k and exp(G_C).
   Binds (from its structure): memory, one read of q, k, g and elementwise work around a cumsum.
2. ``_chunk_pairs_kernel``, per (chunk, head, block i of 16 rows): rows 16 i .. 16 i + 15 of the pair
   matrices A_qk and A_kk, summed over K in slices of KC channels. The pair decay exp(G_r - G_j)
   cannot be factored as exp(G_r) exp(-G_j): over 64 steps near -5 per step exp(-G_j) overflows
   fp32. Instead, for the columns of earlier row blocks (j < 16 i) the first row m = 16 i of block i
   is a reference: exp(G_r - G_j) = exp(G_r - G_m) exp(G_m - G_j) with both exponents <= 0, so that
   part is one ``tl.dot`` of (q * exp(G - G_m)) with (k * exp(G_m - G))^T. Inside the diagonal
   16 x 16 block no such row exists, so the decay is formed pair by pair, one column j at a time
   ([16, KC] in registers, key row j loaded straight into the layout it is broadcast in, so no tile
   changes layout through shared memory, as a [16, 16, KC] broadcast of the same pairs does), with
   the exponent masked to -inf above the diagonal. Every exponent is <= 0: nothing overflows; what
   underflows to 0 is below what fp32 can hold anyway. Binds (profiled): the diagonal block's
   exponentials and in-register layout work; the largest share of the op's GPU time.
3. ``_chunk_solve_kernel``, per (chunk, head): M = (I + Diag(beta) A_kk)^-1, built row block by row
   block in registers: the 16 x 16 diagonal inverse by forward substitution, then M_i = inv(I + A_ii)
   (E_i - A_i,<i M_<i) with dots (block forward substitution). Then W = M (beta exp(G) k) and
   U = M (beta v), WC columns at a time. Pairs and solve are separate kernels because one program
   holding the pairs' temporaries and M at once runs out of registers and spills. Binds (from its
   structure): the sequential substitution inside each 16-row block.
4. ``_chunk_state_kernel``, per (head, tile of V columns): the only sequential part. It walks the
   chunks in order carrying S [K, BLOCK_V] in registers: stores S (the chunk's S0), V_new = U - W S0,
   then S <- exp(G_C) S + Kd^T V_new. Two dots per chunk; W, U, Kd of the next chunk do not depend on
   S, so the compiler's software pipelining (num_stages) prefetches them during the current chunk.
   Binds: its length, NT chunks in order (see below).
5. ``_chunk_output_kernel``, per (chunk, head, V tile: all of V on a GPU), fully parallel:
   O = Qg S0 + A_qk V_new. Binds (from its structure): the reads of its chunk's scratch (Qg, A_qk,
   S0, V_new), each once.

Splitting the state walk (4) from the output (5) keeps the sequential loop at two dots per chunk;
B=1, T=8192, 16 heads gives only 16 x (V / BLOCK_V) programs for it, so its length, not the GPU's
width, bounds it. The price is the per-chunk S0 round trip through memory.

**Precision.** Sums and the state are fp32, and so are the scratch values that are more than a dot
operand (G, U, A_kk). With bf16/fp16 q, k, v on a GPU, the large dots take their operands in that
type (tensor cores, fp32 accumulation, as flash-linear-attention does); the scratch tensors that are
only ever dot operands (Qg, Kd, W, A_qk, V_new, the per-chunk S0) are stored in that type, which the
consumer would convert them to anyway: half the bytes, the same results. Dots on fp32 operands (the
inverse M always, everything for fp32 inputs) use "tf32x3" on a GPU (three TF32 products: about fp32
accuracy on tensor cores; IEEE fp32 dots at these tiles run on the FMA units and spill registers:
``_GPU_F32_DOT`` switches back) and "ieee" in the interpreter, which always computes in fp32 (its
``tl.dot`` on bf16 operands returns garbage: docs/design.md §10).

**Block sizes** (``_chunk_config``): sweeps on the H200, B=1, T=8192, 16 heads x K=V=128 (bench_kda.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_chunk_size, check_lengths, check_recurrence, check_state_at
from .chunk_host import keep_table, scratch
from .io_triton import copy_state, load_state, new_outputs, token_row, wants_reference
from .reference import kda_chunk_ref, kept_states

MAX_CHUNK = 64  # registers: the chunk kernels hold [BC, BC] and [BC, K] tiles
_GPU_F32_DOT = "tf32x3"  # precision of fp32 dots on a GPU ("ieee": exact products, FMA units, slow)
SUB_ROWS = 16  # rows per block of the WY solve; tl.dot needs at least 16
SUB = tl.constexpr(SUB_ROWS)  # the same, as the kernels see it


# --------------------------------------------------------------------------------------- loads
@triton.jit
def _token_tile(ptr, bT, t, ok, head, n_heads, width, d):
    """fp32 tile [len(t), len(d)] of a contiguous [B, T, n_heads, width] tensor: tokens ``bT + t`` of
    one head, columns d; zero where ``ok`` is False or d >= width (masked, never read)."""
    offs = ((bT + t)[:, None] * n_heads + head) * width + d[None, :]
    return tl.load(ptr + offs, mask=ok[:, None] & (d < width)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _scratch_tile(ptr, rows, width: tl.constexpr, cols):
    """Tile [len(rows), len(cols)] of a padded scratch tensor (fp32 or the dot type) with rows of
    ``width`` values."""
    return tl.load(ptr + rows[:, None] * width + cols[None, :])


@triton.jit
def _mm(a, b, DOT: tl.constexpr, F32: tl.constexpr):
    """a @ b with fp32 accumulation, operands converted to DOT; fp32 operands use the F32 precision
    ("ieee" in the interpreter, "tf32x3" on a GPU: fp32-grade tensor-core products, never plain TF32)."""
    return tl.dot(a.to(DOT), b.to(DOT), input_precision=F32)


@triton.jit
def _row_len(len_ptr, b, T, HAS_LEN: tl.constexpr):
    """Row b's real tokens: lengths[b] (the rest is padding, skipped by whole chunks), else T."""
    if HAS_LEN:
        n = tl.load(len_ptr + b).to(tl.int32)
    else:
        n = T
    return n


# ------------------------------------------------------------------------------ chunked: decay
# T, C (chunk) and NT (chunk count) only scale offsets and bound loops, the lengths' address is a slice of the
# step's metadata: left unspecialised, a new prompt length or step compiles no new variant; same speed.
@triton.jit(do_not_specialize=["T", "C", "NT"], do_not_specialize_on_alignment=["len_ptr"])
def _chunk_decay_kernel(q_ptr, k_ptr, g_ptr, G_ptr, qg_ptr, kd_ptr, gl_ptr, len_ptr,
                        T, H, HV, K, REP, C, NT, scale,
                        BC: tl.constexpr, BK: tl.constexpr, HAS_LEN: tl.constexpr):
    """One (chunk, head): G = inclusive cumsum of g over the chunk's rows, Qg = exp(G) scale q,
    Kd = exp(G_C - G) k, exp(G_C), all into scratch rows [BC, BK] (padding rows and columns too)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, hv = bh // HV, bh % HV
    Tb = _row_len(len_ptr, b, T, HAS_LEN)
    if c * C >= Tb:  # all padding: no later kernel reads this chunk
        return
    h = hv // REP
    r = tl.arange(0, BC)
    d = tl.arange(0, BK)
    t = c * C + r
    ok = (r < C) & (t < Tb)
    g = _token_tile(g_ptr, b * T, t, ok, hv, HV, K, d)
    G = tl.cumsum(g, axis=0)  # padding rows add 0: G stays flat past the chunk's last token
    g_last = tl.sum(g, axis=0)  # G_C
    offs = ((bh * NT + c) * BC + r)[:, None] * BK + d[None, :]
    tl.store(G_ptr + offs, G)
    q = _token_tile(q_ptr, b * T, t, ok, h, H, K, d) * scale
    tl.store(qg_ptr + offs, tl.exp(G) * q)
    k = _token_tile(k_ptr, b * T, t, ok, h, H, K, d)
    tl.store(kd_ptr + offs, tl.exp(g_last[None, :] - G) * k)  # G_C - G <= 0
    tl.store(gl_ptr + (bh * NT + c) * BK + d, tl.exp(g_last))


# ------------------------------------------------------------------------ chunked: pair matrices
@triton.jit
def _pair_rows(q_ptr, k_ptr, G_ptr, bT, row0, c, i, T, H, h, K, C, scale,
               BC: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, DOT: tl.constexpr, F32: tl.constexpr):
    """Rows 16 i .. 16 i + 15 of the chunk's pair matrices, summed over K in slices of KC channels:
    A_qk [16, BC] (r >= j), and A_kk without beta split into its columns j < 16 i [16, BC] and its
    diagonal block [16, 16] (r > j).

    Columns of earlier row blocks go through a reference row, the block's first row m = 16 i:
    exp(G_r - G_j) = exp(G_r - G_m) exp(G_m - G_j) with j < m <= r, both factors <= 1, so they are one
    dot of (q * exp(G - G_m)) with (k * exp(G_m - G))^T. Inside the diagonal block no row lies
    between r and j: the decay is formed pair by pair (a column at a time), the exponent
    masked to -inf where r < j so that it is never positive."""
    s16 = tl.arange(0, SUB)
    r = s16 + i * SUB
    ok = (r < C) & (c * C + r < T)
    j = tl.arange(0, BC)
    left = j < i * SUB
    a_qk = tl.zeros([SUB, BC], dtype=tl.float32)
    a_kk = tl.zeros([SUB, BC], dtype=tl.float32)
    d_qk = tl.zeros([SUB, SUB], dtype=tl.float32)
    d_kk = tl.zeros([SUB, SUB], dtype=tl.float32)
    for d0 in range(0, BK, KC):
        d = d0 + tl.arange(0, KC)
        q = _token_tile(q_ptr, bT, c * C + r, ok, h, H, K, d) * scale
        k = _token_tile(k_ptr, bT, c * C + r, ok, h, H, K, d)
        G = _scratch_tile(G_ptr, row0 + r, BK, d)
        g_ref = tl.load(G_ptr + (row0 + i * SUB) * BK + d)
        k_left = _token_tile(k_ptr, bT, c * C + j, left & (j < C) & (c * C + j < T), h, H, K, d)
        k_left *= tl.exp(tl.where(left[:, None], g_ref[None, :] - _scratch_tile(G_ptr, row0 + j, BK, d),
                                  float("-inf")))
        decay = tl.exp(G - g_ref[None, :])
        a_qk += _mm(q * decay, tl.trans(k_left), DOT, F32)
        a_kk += _mm(k * decay, tl.trans(k_left), DOT, F32)
        # One column j of the diagonal block at a time: its key row is loaded straight into the
        # layout the [16, KC] tile broadcasts it in, so no tile changes layout (a [16, 16, KC]
        # broadcast did, through shared memory, and bound the kernel on L1 traffic).
        for jj in range(SUB):
            r_j = d * 0 + i * SUB + jj  # as a vector: the interpreter mishandles vector & scalar masks
            k_j = token_row(k_ptr, bT, c * C + i * SUB + jj, (d < K) & (r_j < C) & (c * C + r_j < T), h, H, K, d)
            e = tl.exp(tl.where((s16 >= jj)[:, None], G - tl.load(G_ptr + (row0 + i * SUB + jj) * BK + d)[None, :],
                                float("-inf"))) * k_j[None, :]
            col = (s16 == jj)[None, :]
            d_qk = tl.where(col, d_qk + tl.sum(q * e, axis=1)[:, None], d_qk)
            d_kk = tl.where(col, d_kk + tl.sum(k * e, axis=1)[:, None], d_kk)
    a_qk += tl.dot(d_qk, _rows_to_columns(i, BC), input_precision=F32)
    return a_qk, a_kk, tl.where(s16[:, None] > s16[None, :], d_kk, 0.0)


@triton.jit
def _rows_to_columns(i, BC: tl.constexpr):
    """0/1 matrix [16, BC] mapping row s of a 16 x 16 block to column 16 i + s of a [., BC] tile:
    a dot with it places the block exactly (each result is one product by 1.0, plus zeros)."""
    return (tl.arange(0, BC)[None, :] == (tl.arange(0, SUB) + i * SUB)[:, None]).to(tl.float32)


@triton.jit
def _unit_lower_inverse(A):
    """(I + A)^-1 for a strictly lower triangular A [16, 16], by forward substitution on rows:
    row s of the inverse is e_s - sum_{j<s} A[s, j] (row j of the inverse)."""
    r = tl.arange(0, SUB)
    inv = (r[:, None] == r[None, :]).to(tl.float32)
    for s in range(1, SUB):
        a_s = tl.sum(tl.where(r[:, None] == s, A, 0.0), axis=0)  # row s of A (zero from column s on)
        row = tl.sum(a_s[:, None] * inv, axis=0)  # rows j < s of inv are final; a_s is 0 elsewhere
        inv = tl.where(r[:, None] == s, inv - row[None, :], inv)
    return inv


@triton.jit
def _extend_inverse(M, a_off, a_diag, i, BC: tl.constexpr, F32: tl.constexpr):
    """Fill rows of block i of M = (I + A_kk)^-1 [BC, BC], whose rows of blocks < i are done (later
    rows still zero). Row block i of (I + A) M = I reads (I + A_ii) M_i = E_i - A_i,<i M_<i, so
    M_i = inv(I + A_ii) (E_i - a_off M): block forward substitution, always in fp32 (F32 dots)."""
    E_i = _rows_to_columns(i, BC)  # also rows 16 i.. of the identity
    R = E_i - tl.dot(a_off, M, input_precision=F32)
    M_i = tl.dot(_unit_lower_inverse(a_diag), R, input_precision=F32)
    return M + tl.dot(tl.trans(E_i), M_i, input_precision=F32)  # M_i into rows 16 i..


@triton.jit(do_not_specialize=["T", "C", "NT"], do_not_specialize_on_alignment=["len_ptr"])
def _chunk_pairs_kernel(q_ptr, k_ptr, G_ptr, aqk_ptr, akk_ptr, len_ptr, T, H, HV, K, REP, C, NT, scale,
                        BC: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, DOT: tl.constexpr,
                        F32: tl.constexpr, HAS_LEN: tl.constexpr):
    """One (chunk, head, row block i): rows 16 i .. 16 i + 15 of A_qk (into its scratch, in the dot
    type: it is only ever a dot operand) and of A_kk without beta (fp32: the solve reads it as it
    was computed). A_kk's columns j < 16 i and its diagonal block are two stores to disjoint
    addresses; the columns after the block are never read."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    i = tl.program_id(2)
    b, hv = bh // HV, bh % HV
    Tb = _row_len(len_ptr, b, T, HAS_LEN)
    if c * C >= Tb:
        return
    row0 = (bh * NT + c) * BC  # first scratch row of this chunk
    a_qk, a_off, a_diag = _pair_rows(q_ptr, k_ptr, G_ptr, b * T, row0, c, i, Tb, H, hv // REP, K, C, scale,
                                     BC, BK, KC, DOT, F32)
    s16 = tl.arange(0, SUB)
    rows = (row0 + s16 + i * SUB)[:, None] * BC
    cols = tl.arange(0, BC)[None, :]
    tl.store(aqk_ptr + rows + cols, a_qk)
    tl.store(akk_ptr + rows + cols, a_off, mask=cols < i * SUB)
    tl.store(akk_ptr + rows + (s16 + i * SUB)[None, :], a_diag)


@triton.jit(do_not_specialize=["T", "C", "NT"], do_not_specialize_on_alignment=["len_ptr"])
def _chunk_solve_kernel(k_ptr, v_ptr, beta_ptr, G_ptr, akk_ptr, w_ptr, u_ptr, len_ptr,
                        T, H, HV, K, V, REP, C, NT, BC: tl.constexpr, BK: tl.constexpr,
                        BVF: tl.constexpr, WC: tl.constexpr, DOT: tl.constexpr, F32: tl.constexpr,
                        HAS_LEN: tl.constexpr):
    """One (chunk, head): M = (I + Diag(beta) A_kk)^-1 in registers, then W and U out."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, hv = bh // HV, bh % HV
    bT = b * T
    T = _row_len(len_ptr, b, T, HAS_LEN)  # masks below: the row's real tokens
    if c * C >= T:
        return
    h = hv // REP
    row0 = (bh * NT + c) * BC
    cols = tl.arange(0, BC)
    s16 = tl.arange(0, SUB)
    M = tl.zeros([BC, BC], dtype=tl.float32)
    for i in range(BC // SUB):
        r = s16 + i * SUB
        ok = (r < C) & (c * C + r < T)
        beta_i = tl.load(beta_ptr + (bT + c * C + r) * HV + hv, mask=ok, other=0.0).to(tl.float32)
        a_off = tl.load(akk_ptr + (row0 + r)[:, None] * BC + cols[None, :], mask=(cols < i * SUB)[None, :],
                        other=0.0)
        a_diag = tl.load(akk_ptr + (row0 + r)[:, None] * BC + r[None, :])  # the diagonal block
        M = _extend_inverse(M, a_off * beta_i[:, None], a_diag * beta_i[:, None], i, BC, F32)
    # W = M Diag(beta) (exp(G) * k) and U = M Diag(beta) v, WC columns at a time (registers).
    t = c * C + cols
    ok = (cols < C) & (t < T)
    beta = tl.load(beta_ptr + (bT + t) * HV + hv, mask=ok, other=0.0).to(tl.float32)
    for d0 in range(0, BK, WC):
        d = d0 + tl.arange(0, WC)
        x = _token_tile(k_ptr, bT, t, ok, h, H, K, d) * tl.exp(_scratch_tile(G_ptr, row0 + cols, BK, d))
        tl.store(w_ptr + (row0 + cols)[:, None] * BK + d[None, :], _mm(M, x * beta[:, None], DOT, F32))
    for e0 in range(0, BVF, WC):
        e = e0 + tl.arange(0, WC)
        y = _token_tile(v_ptr, bT, t, ok, hv, HV, V, e) * beta[:, None]
        tl.store(u_ptr + (row0 + cols)[:, None] * BVF + e[None, :], _mm(M, y, DOT, F32))


# ---------------------------------------------------------------------------- chunked: state walk
@triton.jit
def _keep_state(keep_ptr, kept_ptr, bh, HV, c, NT, K, V, d, e, S):
    """Store S (the state at the start of chunk c, or the final one at c = NT) as kept state m = keep[b, c]
    of the table [B, NT + 1] (-1: not asked for), fp32, at kept[m, hv]."""
    b, hv = bh // HV, bh % HV
    m = tl.load(keep_ptr + b * (NT + 1) + c).to(tl.int64)
    if m >= 0:
        offs = ((m * HV + hv) * K + d[:, None]) * V + e[None, :]
        tl.store(kept_ptr + offs, S, mask=(d < K)[:, None] & (e < V)[None, :])


@triton.jit(do_not_specialize=["C", "NT"], do_not_specialize_on_alignment=["len_ptr"])
def _chunk_state_kernel(w_ptr, u_ptr, kd_ptr, gl_ptr, s0_ptr, hs_ptr, vn_ptr, s_ptr, keep_ptr, kept_ptr, len_ptr, HV,
                        K, V, C, NT, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr,
                        HAS_S0: tl.constexpr, KEEP: tl.constexpr, HAS_LEN: tl.constexpr, DOT: tl.constexpr,
                        F32: tl.constexpr):
    """One (head, V tile), chunks in order: store S0 of each chunk and V_new = U - W S0, then
    S <- exp(G_C) S + Kd^T V_new. The state [BK, BV] never leaves registers in between; with KEEP, the
    chunk starts and the end that the table asks for are also stored in fp32."""
    bh = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BK)
    e = tl.program_id(1) * BV + tl.arange(0, BV)  # < BVF: the grid covers the padded width exactly
    r = tl.arange(0, BC)
    S, state_offs, state_mask = load_state(s0_ptr, bh, K, V, d, e, BK, BV, HAS_S0)
    n = tl.cdiv(_row_len(len_ptr, bh // HV, NT * C, HAS_LEN), C)  # chunks with real tokens; the rest is inert
    for c in range(n):
        rows = (bh * NT + c) * BC + r
        tl.store(hs_ptr + (bh * NT + c) * BK * BVF + d[:, None] * BVF + e[None, :], S)
        if KEEP:
            _keep_state(keep_ptr, kept_ptr, bh, HV, c, NT, K, V, d, e, S)
        u = _scratch_tile(u_ptr, rows, BVF, e)
        v_new = u - _mm(_scratch_tile(w_ptr, rows, BK, d), S, DOT, F32)
        tl.store(vn_ptr + rows[:, None] * BVF + e[None, :], v_new)
        kd = _scratch_tile(kd_ptr, rows, BK, d)
        decay = tl.load(gl_ptr + (bh * NT + c) * BK + d)  # exp(G_C) per key channel
        S = S * decay[:, None] + _mm(tl.trans(kd), v_new, DOT, F32)
    tl.store(s_ptr + state_offs, S, mask=state_mask)
    if KEEP:  # the starts of the skipped chunks and the end: all the final state
        for c in range(n, NT + 1):
            _keep_state(keep_ptr, kept_ptr, bh, HV, c, NT, K, V, d, e, S)


@triton.jit(do_not_specialize=["T", "C", "NT"], do_not_specialize_on_alignment=["len_ptr"])
def _chunk_output_kernel(qg_ptr, aqk_ptr, hs_ptr, vn_ptr, o_ptr, len_ptr, T, HV, V, C, NT,
                         BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr,
                         DOT: tl.constexpr, F32: tl.constexpr, HAS_LEN: tl.constexpr):
    """One (chunk, head, V tile): O = Qg S0 + A_qk V_new, stored for the chunk's real tokens only (o is zero
    where lengths leave padding)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, hv = bh // HV, bh % HV
    Tb = _row_len(len_ptr, b, T, HAS_LEN)
    if c * C >= Tb:
        return
    r = tl.arange(0, BC)
    d = tl.arange(0, BK)
    e = tl.program_id(2) * BV + tl.arange(0, BV)
    rows = (bh * NT + c) * BC + r
    s0 = tl.load(hs_ptr + (bh * NT + c) * BK * BVF + d[:, None] * BVF + e[None, :])
    o = _mm(_scratch_tile(qg_ptr, rows, BK, d), s0, DOT, F32)
    o += _mm(_scratch_tile(aqk_ptr, rows, BC, r), _scratch_tile(vn_ptr, rows, BVF, e), DOT, F32)
    t = c * C + r
    ok = (r < C) & (t < Tb)
    offs = ((b * T + t)[:, None] * HV + hv) * V + e[None, :]
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=ok[:, None] & (e < V)[None, :])


# ----------------------------------------------------------------------------------- launches
def _dot_types(q, k, v) -> tuple:
    """(operand type of the large dots, precision of fp32 dots). On a GPU: 16-bit tensor-core operands
    when q, k and v all are that type, and "tf32x3" for fp32 dots (three TF32 products: about fp32
    accuracy on tensor cores; IEEE fp32 dots at these tiles run on the FMA units and spill registers).
    The interpreter: fp32 and "ieee"."""
    if v.device.type != "cuda":
        return tl.float32, "ieee"
    half = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    return (half[v.dtype] if q.dtype == k.dtype == v.dtype and v.dtype in half else tl.float32), _GPU_F32_DOT


def _chunk_config(BK: int, BVF: int, device: torch.device) -> dict:
    """Tile sizes and warps of the chunk kernels, from sweeps on the H200 (K = V = 128, chunk 64).

    BV: V columns per program of the state walk (32 and 64 time alike; 32 gives the walk, which has
    only B*HV x V / BV programs, twice as many). out_BV: V columns per program of the output, all of
    them: each program then reads its chunk's Qg and A_qk once instead of once per V tile. KC: key
    channels per slice of the pair matrices (32, the fastest of 16, 32 and 64). WC: columns per slice
    of W and U (it divides both widths: all are powers of two; 32-128 time alike). Warps: 4 for every
    kernel (8 is slower for the pairs and for the solve). The interpreter takes whole widths: it pays
    per operation."""
    if device.type != "cuda":
        return dict(BV=BVF, out_BV=BVF, KC=BK, WC=min(BK, BVF), warps=4, pair_warps=4, solve_warps=4,
                    state_warps=4)
    return dict(BV=min(32, BVF), out_BV=BVF, KC=min(32, BK), WC=min(64, BK, BVF), warps=4, pair_warps=4,
                solve_warps=4, state_warps=4)


def _launch_chunk(q, k, v, g, beta, scale, initial_state, chunk_size, state_at=None, lengths=None, config=None):
    """Run the five chunk kernels on checked, non-fp64 inputs. ``config`` overrides entries of
    ``_chunk_config`` (tests use it to run the GPU's slicing in the interpreter)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o, state = new_outputs(q, v)
    M = 0 if state_at is None else state_at.shape[0]
    kept = torch.zeros(M, HV, K, V, dtype=torch.float32, device=v.device)
    if state.numel() == 0 or T == 0:  # nothing to run (K = 0 leaves o = S^T q = 0)
        state = copy_state(initial_state, state)
        return o.zero_(), state, kept_states([state], state_at, T, 1) if M else kept
    if lengths is not None:
        o.zero_()  # chunks past a row's length are skipped: their o stays 0
    C = max(1, min(chunk_size, T, MAX_CHUNK))  # the result does not depend on C, only its rounding does
    BC, BK = max(SUB_ROWS, triton.next_power_of_2(C)), max(16, triton.next_power_of_2(K))
    BVF, NT, BH = max(16, triton.next_power_of_2(V)), triton.cdiv(T, C), B * HV
    cfg = {**_chunk_config(BK, BVF, v.device), **(config or {})}
    dot, f32 = _dot_types(q, k, v)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    x = scratch(BH, NT, BC, BK, BVF, v, dot)
    lens = lengths.contiguous() if lengths is not None else state  # placeholder when absent
    kw = dict(BC=BC, BK=BK, HAS_LEN=lengths is not None)
    _chunk_decay_kernel[(NT, BH)](q, k, g, x["G"], x["qg"], x["kd"], x["decay"], lens, T, H, HV, K, HV // H, C, NT,
                                  scale, **kw, num_warps=cfg["warps"])
    kw.update(DOT=dot, F32=f32)
    _chunk_pairs_kernel[(NT, BH, BC // SUB_ROWS)](q, k, x["G"], x["aqk"], x["akk"], lens, T, H, HV, K, HV // H, C,
                                                   NT, scale, KC=cfg["KC"], **kw, num_warps=cfg["pair_warps"])
    _chunk_solve_kernel[(NT, BH)](k, v, beta, x["G"], x["akk"], x["w"], x["u"], lens, T, H, HV, K, V, HV // H, C, NT,
                                  BVF=BVF, WC=cfg["WC"], **kw, num_warps=cfg["solve_warps"])
    s0 = initial_state.contiguous() if initial_state is not None else state  # placeholder when absent
    keep = keep_table(state_at, B, T, C, NT) if M else state  # placeholder when absent
    kw.update(BV=cfg["BV"], BVF=BVF)
    _chunk_state_kernel[(BH, BVF // cfg["BV"])](x["w"], x["u"], x["kd"], x["decay"], s0, x["s0"], x["v_new"], state,
                                                keep, kept, lens, HV, K, V, C, NT, HAS_S0=initial_state is not None,
                                                KEEP=M > 0, num_stages=2, **kw, num_warps=cfg["state_warps"])
    kw.update(BV=cfg["out_BV"])
    _chunk_output_kernel[(NT, BH, BVF // cfg["out_BV"])](x["qg"], x["aqk"], x["s0"], x["v_new"], o, lens, T, HV, V, C,
                                                         NT, **kw, num_warps=cfg["warps"])
    return o, state, kept


# ------------------------------------------------------------------------------------ public op
def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float | None = None,
              initial_state: torch.Tensor | None = None, chunk_size: int = 64, state_at: torch.Tensor | None = None,
              lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked KDA (WY form), equal to ``kda_recurrent`` up to rounding; T need not be a multiple of
    the chunk. Shapes and results as ``kda_chunk_ref`` (o, final state, kept states; ``lengths``: each row's
    real tokens, whole chunks past them skipped); chunks hold min(chunk_size, 64) tokens, so kept states need
    a chunk_size of at most 64 or a multiple of it."""
    check_chunk_size(chunk_size)
    B, T = check_recurrence(q, k, v, g, beta, initial_state)[:2]
    check_state_at(state_at, B, T, chunk_size)
    if state_at is not None and chunk_size > MAX_CHUNK and chunk_size % MAX_CHUNK:
        raise ValueError(f"kept states need chunk_size <= {MAX_CHUNK} or a multiple of it, got {chunk_size}")
    if lengths is not None:
        lengths = check_lengths(lengths, B, T)
    if wants_reference(q, k, v, g, beta, initial_state):
        return kda_chunk_ref(q, k, v, g, beta, scale, initial_state, chunk_size, state_at, lengths)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _launch_chunk(q, k, v, g, beta, scale, initial_state, chunk_size, state_at, lengths)
