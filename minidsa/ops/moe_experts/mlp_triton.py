"""Triton kernels of the routed-expert MLPs (docs/design.md §6, §7, §12): ``expert_mlp_fp8`` over the FP8
workspace slots and ``expert_mlp_mxfp4`` straight from MXFP4 storage. Same signatures and results as the
``*_ref`` ops of ``reference.py`` (to fp32 rounding: tests/ops/test_triton_moe.py); fp64 inputs
(exactness tests only) go to the reference.

Three launches, grouped over all slots, no Python loop over experts and no atomics:

1. *up*: grid ``(token tile, block of BLOCK_R rows of I, slot)`` (compact: ``(tile list entry, rows, 1)``).
   A program walks L in BLOCK_K steps, dequantises a [BLOCK_R, BLOCK_K] tile of w1 and of w3 in
   registers (MXFP4 as its even and odd planes along K, which its packed bytes decode into; FP8
   whole: ``dequant_triton.py``), and accumulates ``g, u [BLOCK_R, BLOCK_T] += W @ z^T`` in fp32
   (one product per plane, or one per FP8 tile; weights are the dot's M, 64-128 rows; a token tile
   short of BLOCK_T is padded by masked lanes). It then applies SiTU-GLU and the gate and writes
   ``h = gate * SiTU-GLU(g, u)`` [BLOCK_T, BLOCK_R] rows.
2. *down*: grid ``(token tile, block of BLOCK_R rows of L, slot)``: ``part = h @ W2^T`` per
   (slot, token) pair, written to a per-pair buffer [pairs, L].
3. *combine*: one program per (token, BLOCK_L columns) sums its pairs' rows over the slots in a
   fixed order (a masked [BLOCK_S, BLOCK_L] gather per step, then a tree sum). The split of the
   expert sum into per-pair rows and a separate ordered reduction is what makes the result bitwise
   reproducible without atomics.
For one token (the dense layout; MXFP4 up to ``MXFP4_GEMV_MAX_TOKENS``) the up and down programs run
matrix-vector products on the FMA units instead of tensor-core tiles (``matvec_triton.py``).

*Skipping unrouted pairs.* A token lane is live only where ``routing[slot, token] != 0``: dead lanes
load nothing and store nothing, and a program with no live lane reads no weight at all, so
placeholder slots (docs/design.md §14) cost a few gate loads. Two pair layouts, chosen by shape:
- dense (decode: N <= BLOCK_T, or up to ``DENSE_MAX_TOKENS`` while its buffers stay under
  ``DENSE_PAIR_BYTES``): pair (slot, token) is row ``slot * N + token``; a step is one or a few token
  tiles (or, MXFP4, one walk over the slot's routed tokens), so little is to be gained from
  compaction, and no host sync is needed, which a decode step cannot afford in every MoE layer
  (docs/design.md §14).
- compact (prefill): each slot's routed tokens are listed in ascending order (``lists_triton.py``, three
  launches: rank = running count of the routed mask, offsets = running sum of the counts), and token
  tiles walk those lists, so compute scales with the routed pairs, not with slots x tokens. The tiles of all slots form
  one list (vLLM's fused MoE aligns its sorted tokens to blocks the same way): grid axis 0 holds a bound
  on its length, pairs / BLOCK_T + slots, where a grid of slots x token tiles of the longest list would
  launch mostly empty programs (with N tokens over m slots, top-k each: m N / BLOCK_T programs for
  about k N / BLOCK_T tiles of work). The buffers are sized by the caller's bound on the routed pairs
  (N * top_k, no host sync) or by the count read back (one host sync; decode batches within the dense
  limits never take this path).

*Precision.* Accumulation is fp32. On the GPU each weight tile is cast to bf16 (exact: e4m3 has
3 mantissa bits) and the fp32 activations are split into ``hi = bf16(x)``, ``lo = bf16(x - hi)``;
two bf16 tensor-core dots then carry about 16 mantissa bits of x (relative error <= 2^-17 per
product, against 2^-24 for fp32) instead of the 8 of a single bf16 dot. A bf16 z (a bf16 model) is
exact in one dot, so the up pass then runs one; h, the up pass's fp32 output, always takes two. The interpreter computes
fp32 dots with ``input_precision="ieee"`` (its bf16 tl.dot is wrong: docs/design.md §12).

*Bytes moved* per routed expert with I*L elements per matrix (K3: I*L = 11.0 M):
- fused MXFP4 MLP: 3 * I*L * (1/2 + 1/32) = 17.6 MB of weights, read from DRAM once per launch at
  decode (a second routed token of the slot re-reads them, mostly from L2);
- workspace path: conversion (51.6 MB, ``convert_triton.py``) + MLP over FP8, 3 * I*L * (1 + 1/32) = 34.1 MB;
- bf16 weights (the plain-torch peer): 3 * I*L * 2 = 66.1 MB.
At decode (one token tile) every weight byte of a routed slot is read from DRAM once; the h and
per-pair buffers (N*(I+L)*4 bytes per slot) are small beside them. At prefill each token tile of a
slot re-reads that slot's tile rows; consecutive programs share them (token tile is the fastest grid
axis), so most repeats hit L2. Prefill at K3 shapes (4096 tokens, top-16 of 256) runs at ~87-95 TFLOP/s,
11-12 % of the H200's 790: far from the tensor cores' limit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activation.situ_glu_triton import situ_glu_tl
from .checks import check_fp8_mlp, check_mxfp4_mlp
from .convert_triton import require_rows_contiguous
from .dequant_triton import group_scales, weight_planes, weight_tile
from .lists_triton import compact_lists
from .matvec_triton import down_decode, gemv_meta, gemv_rows, up_decode
from .reference import expert_mlp_fp8_ref, expert_mlp_mxfp4_ref

# Calls of up to DENSE_MAX_TOKENS tokens (decode batches) use the dense pair layout, which needs no host
# sync, while its two pair buffers (slots x tokens rows of I and L fp32) fit in DENSE_PAIR_BYTES: every
# decode batch of the scaled configs, and K3's up to 16 tokens (256 slots: 109 MB). Larger calls compact.
DENSE_MAX_TOKENS = 64
DENSE_PAIR_BYTES = 256 * 2**20
# The MXFP4 MLP for one token runs matrix-vector products; for several it runs tensor-core tiles that decode
# each weight tile once per token tile and share it among the slot's tokens, where matrix-vector products
# decode the slot again for each routed token (docs/design.md §17; measured: docs/benchmarks.md).
MXFP4_GEMV_MAX_TOKENS = 1


@triton.jit
def _dot(w, x_t, acc, DOTS: tl.constexpr):
    """acc + w @ x_t for w [R, K] (bf16-exact weights) and fp32 x_t [K, T], accumulated in fp32. DOTS: bf16
    tensor-core dots (GPU): 2 carry ~16 mantissa bits of x, 1 for an x exact in bf16; 0: fp32 (interpreter)."""
    if DOTS == 0:
        acc = tl.dot(w, x_t, acc, input_precision="ieee")
    else:
        wb = w.to(tl.bfloat16)
        hi = x_t.to(tl.bfloat16)
        acc = tl.dot(wb, hi, acc)
        if DOTS == 2:
            acc = tl.dot(wb, (x_t - hi.to(tl.float32)).to(tl.bfloat16), acc)
    return acc


@triton.jit
def _dot_planes(w, x, acc, DOTS: tl.constexpr):
    """acc + W @ x for a tile given as its (even, odd) planes along K (``dequant_triton``): w [R, BK / 2] and
    x [BK / 2, T] each."""
    return _dot(w[1], x[1], _dot(w[0], x[0], acc, DOTS), DOTS)


@triton.jit
def _x_planes(x_ptr, x_row, live, K, k0, BK: tl.constexpr):
    """Rows x_row [T] of an fp32 [*, K] activation matrix at columns k0..k0+BK, transposed, as (even, odd)
    planes [BK / 2, T] each: zero for dead lanes and past K. Loaded as whole rows (vector loads) and split
    in registers: strided loads of either plane alone would be one 4-byte copy per element."""
    k = k0 + tl.arange(0, BK)
    x = tl.load(x_ptr + x_row[:, None] * K + k[None, :], mask=live[:, None] & (k < K)[None, :], other=0.0)
    x = x.to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (x_row.shape[0], BK // 2, 2)))
    return tl.trans(even), tl.trans(odd)


@triton.jit
def _x_tile(x_ptr, x_row, live, K, k0, BK: tl.constexpr):
    """Rows x_row [T] of an fp32 [*, K] activation matrix at columns k0..k0+BK, transposed: [BK, T] fp32, zero
    for dead lanes and past K (the FP8 tiles' operand, in element order)."""
    k = k0 + tl.arange(0, BK)
    x = tl.load(x_ptr + x_row[:, None] * K + k[None, :], mask=live[:, None] & (k < K)[None, :], other=0.0)
    return tl.trans(x.to(tl.float32))


# ---------------------------------------------------------------------------------------- MLP passes
@triton.jit
def _program_tile(tile_end_ptr, m, DENSE: tl.constexpr, BLOCK_M: tl.constexpr):
    """(slot, token tile, has work) of a tiled program. Dense: the grid's axes 2 and 0. Compact: program p of
    axis 0 takes the p-th entry of the tile list, every slot's token tiles in slot order (tile_end [m]: their
    inclusive running sum), so the grid holds the routed pairs' tiles rather than slots x token tiles; a
    program past the list's end has none."""
    if DENSE:
        return tl.program_id(2), tl.program_id(0), True
    p = tl.program_id(0)
    j = tl.arange(0, BLOCK_M)
    ends = tl.load(tile_end_ptr + j, mask=j < m, other=2147483647)
    slot = tl.sum((ends <= p).to(tl.int32), axis=0)  # slots whose tiles all come before p
    has = slot < m
    slot = tl.minimum(slot, m - 1)
    start = tl.where(slot > 0, tl.load(tile_end_ptr + tl.maximum(slot - 1, 0)), 0).to(tl.int32)
    return slot, p - start, has


@triton.jit
def _pairs(slot, tile, has, routing_ptr, count_ptr, offset_ptr, token_ptr, N, DENSE: tl.constexpr,
           BLOCK_T: tl.constexpr):
    """The token lanes of a program: (pair row int64, token, gate fp32, live) [BLOCK_T] each."""
    j = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    if DENSE:  # pair (slot, token) is row slot * N + token
        inside = j < N
        token = j
        pair = slot.to(tl.int64) * N + j
    else:  # the slot's routed tokens, listed from its offset
        inside = j < tl.where(has, tl.load(count_ptr + slot), 0)
        pair = tl.load(offset_ptr + slot).to(tl.int64) + j
        token = tl.load(token_ptr + pair, mask=inside, other=0)
    gate = tl.load(routing_ptr + slot.to(tl.int64) * N + token, mask=inside, other=0.0).to(tl.float32)
    return pair, token, gate, inside & (gate != 0.0)


@triton.jit
def _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP: tl.constexpr):
    """Base pointers of the slot's expert block (slot j -> experts[j] for MXFP4 storage)."""
    if HAS_MAP:
        e = tl.load(experts_ptr + slot).to(tl.int64)
    else:
        e = slot.to(tl.int64)
    return w_ptr + e * sw_e, s_ptr + e * ss_e


@triton.jit
def _up_step(w1, w3, sg, su, z_ptr, token, live, L, k0, acc_g, acc_u, rows, row_ok, MXFP4: tl.constexpr,
             PTX: tl.constexpr, DOTS: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    """One BK step of the up pass: (acc_g, acc_u) + (W1, W3)[rows, k0:k0 + BK] @ z[token, k0:k0 + BK]^T, the
    tiles' group scales sg, su already loaded. MXFP4 tiles as the planes their packed bytes decode into; FP8 whole."""
    if MXFP4:
        z_t = _x_planes(z_ptr, token, live, L, k0, BK)
        acc_g = _dot_planes(weight_planes(w1, sg, rows, row_ok, L, k0, PTX, ROWS, BK), z_t, acc_g, DOTS)
        acc_u = _dot_planes(weight_planes(w3, su, rows, row_ok, L, k0, PTX, ROWS, BK), z_t, acc_u, DOTS)
    else:
        z_t = _x_tile(z_ptr, token, live, L, k0, BK)
        acc_g = _dot(weight_tile(w1, sg, rows, row_ok, L, k0, ROWS, BK), z_t, acc_g, DOTS)
        acc_u = _dot(weight_tile(w3, su, rows, row_ok, L, k0, ROWS, BK), z_t, acc_u, DOTS)
    return acc_g, acc_u


# N (tokens) is left unspecialised in the three passes: a new token count (prompt length, batch) compiles
# no new variant; it only masks token rows and scales offsets.
@triton.jit(do_not_specialize=["m", "N"])
def _up_kernel(z_ptr, w_ptr, s_ptr, experts_ptr, routing_ptr, count_ptr, offset_ptr, token_ptr, tile_end_ptr, h_ptr,
               m, N, L, I, sw_e, sw_m, ss_e, ss_m, beta_gate, beta_up,
               MXFP4: tl.constexpr, HAS_MAP: tl.constexpr, DENSE: tl.constexpr, DOTS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GEMV: tl.constexpr,
               PTX: tl.constexpr, RB: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
               HC: tl.constexpr):
    """h[pair, rows] = gate * SiTU-GLU(W1 z, W3 z) for one slot, BLOCK_R rows of I and one token tile."""
    slot = tl.program_id(2)
    if GEMV and MXFP4:  # decode, MXFP4: matrix-vector products over the slot's routed tokens
        w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
        up_decode(z_ptr, w1, s1, sw_m, ss_m, routing_ptr, h_ptr, slot, N, L, I, beta_gate, beta_up, BLOCK_R, RB, GA, GB,
                   HC, PTX)
        return
    if GEMV:  # one token, FP8: the slot's pair is row ``slot``
        gate = tl.load(routing_ptr + slot).to(tl.float32)
        if gate != 0.0:
            rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
            row_ok = rows < I
            w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
            g = gemv_rows(w1, s1, rows, row_ok, L, z_ptr, BLOCK_R, BLOCK_K)
            u = gemv_rows(w1 + sw_m, s1 + ss_m, rows, row_ok, L, z_ptr, BLOCK_R, BLOCK_K)
            h = situ_glu_tl(g, u, beta_gate, beta_up) * gate
            tl.store(h_ptr + slot.to(tl.int64) * I + rows, h, mask=row_ok)
        return
    slot, tile, has = _program_tile(tile_end_ptr, m, DENSE, BLOCK_M)
    pair, token, gate, live = _pairs(slot, tile, has, routing_ptr, count_ptr, offset_ptr, token_ptr, N, DENSE,
                                     BLOCK_T)
    if tl.max(live.to(tl.int32), axis=0) > 0:  # no routed token here: read no weight at all
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < I
        w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
        acc_g = tl.zeros((BLOCK_R, BLOCK_T), tl.float32)
        acc_u = tl.zeros((BLOCK_R, BLOCK_T), tl.float32)
        sg = group_scales(s1, rows, row_ok, L // 32, 0, BLOCK_R, BLOCK_K)
        su = group_scales(s1 + ss_m, rows, row_ok, L // 32, 0, BLOCK_R, BLOCK_K)
        for k0 in range(0, L, BLOCK_K):
            # the next step's group scales now (the compiler does not prefetch these uint8 loads)
            sg_next = group_scales(s1, rows, row_ok, L // 32, k0 + BLOCK_K, BLOCK_R, BLOCK_K)
            su_next = group_scales(s1 + ss_m, rows, row_ok, L // 32, k0 + BLOCK_K, BLOCK_R, BLOCK_K)
            acc_g, acc_u = _up_step(w1, w1 + sw_m, sg, su, z_ptr, token, live, L, k0, acc_g, acc_u, rows, row_ok,
                                    MXFP4, PTX, DOTS, BLOCK_R, BLOCK_K)
            sg, su = sg_next, su_next
        h = situ_glu_tl(acc_g, acc_u, beta_gate, beta_up) * gate[None, :]
        tl.store(h_ptr + pair[None, :] * I + rows[:, None], h, mask=row_ok[:, None] & live[None, :])


@triton.jit(do_not_specialize=["m", "N"])
def _down_kernel(h_ptr, w_ptr, s_ptr, experts_ptr, routing_ptr, count_ptr, offset_ptr, token_ptr, tile_end_ptr,
                 part_ptr, m, N, L, I, sw_e, sw_m, ss_e, ss_m,
                 MXFP4: tl.constexpr, HAS_MAP: tl.constexpr, DENSE: tl.constexpr, DOTS: tl.constexpr,
                 BLOCK_M: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GEMV: tl.constexpr,
               PTX: tl.constexpr, RB: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
               HC: tl.constexpr):
    """part[pair, rows] = W2[rows] @ h[pair] for one slot, BLOCK_R latent rows and one token tile."""
    slot = tl.program_id(2)
    if GEMV and MXFP4:
        w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
        down_decode(h_ptr, w1 + 2 * sw_m, s1 + 2 * ss_m, routing_ptr, part_ptr, slot, N, L, I, BLOCK_R, RB, GA, GB, HC,
                     PTX)
        return
    if GEMV:
        if tl.load(routing_ptr + slot).to(tl.float32) != 0.0:
            rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
            row_ok = rows < L
            w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
            part = gemv_rows(w1 + 2 * sw_m, s1 + 2 * ss_m, rows, row_ok, I, h_ptr + slot.to(tl.int64) * I, BLOCK_R,
                              BLOCK_K)
            tl.store(part_ptr + slot.to(tl.int64) * L + rows, part, mask=row_ok)
        return
    slot, tile, has = _program_tile(tile_end_ptr, m, DENSE, BLOCK_M)
    pair, token, gate, live = _pairs(slot, tile, has, routing_ptr, count_ptr, offset_ptr, token_ptr, N, DENSE,
                                     BLOCK_T)
    if tl.max(live.to(tl.int32), axis=0) > 0:
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < L
        w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
        acc = tl.zeros((BLOCK_R, BLOCK_T), tl.float32)
        s2 = s1 + 2 * ss_m
        sc = group_scales(s2, rows, row_ok, I // 32, 0, BLOCK_R, BLOCK_K)
        for k0 in range(0, I, BLOCK_K):
            sc_next = group_scales(s2, rows, row_ok, I // 32, k0 + BLOCK_K, BLOCK_R, BLOCK_K)
            if MXFP4:
                h_t = _x_planes(h_ptr, pair, live, I, k0, BLOCK_K)
                w2 = weight_planes(w1 + 2 * sw_m, sc, rows, row_ok, I, k0, PTX, BLOCK_R, BLOCK_K)
                acc = _dot_planes(w2, h_t, acc, DOTS)
            else:
                acc = _dot(weight_tile(w1 + 2 * sw_m, sc, rows, row_ok, I, k0, BLOCK_R, BLOCK_K),
                           _x_tile(h_ptr, pair, live, I, k0, BLOCK_K), acc, DOTS)
            sc = sc_next
        tl.store(part_ptr + pair[None, :] * L + rows[:, None], acc, mask=row_ok[:, None] & live[None, :])


@triton.jit(do_not_specialize=["m", "N"])
def _combine_kernel(part_ptr, routing_ptr, rank_ptr, offset_ptr, out_ptr, m, N, L, DENSE: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):
    """y[token, cols] = sum over slots (fixed order) of the token's per-pair rows; unrouted slots skipped."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    col_ok = cols < L
    acc = tl.zeros((BLOCK_L,), tl.float32)
    for s0 in range(0, m, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        routed = (s < m) & (tl.load(routing_ptr + s.to(tl.int64) * N + token, mask=s < m, other=0.0) != 0.0)
        if DENSE:
            pair = s.to(tl.int64) * N + token
        else:  # rank is the inclusive count of routed tokens up to this one in the slot's list
            rank = tl.load(rank_ptr + s.to(tl.int64) * N + token, mask=routed, other=1)
            pair = tl.load(offset_ptr + s, mask=routed, other=0).to(tl.int64) + rank - 1
        rows = tl.load(part_ptr + pair[:, None] * L + cols[None, :], mask=routed[:, None] & col_ok[None, :],
                       other=0.0)
        acc += tl.sum(rows, axis=0)
    tl.store(out_ptr + token.to(tl.int64) * L + cols, acc, mask=col_ok)


# -------------------------------------------------------------------------------------------- launch
def _config(on_gpu: bool, dense: bool, N: int = 1) -> dict:
    """Tile sizes: decode (dense) favours many small weight-streaming programs; prefill (compact) a
    tensor-core-sized tile of 64 weight rows x 128 tokens. The interpreter gets the smallest legal
    tiles (it pays per program and per element). BLOCK_K is a multiple of the 32-element scale group.
    A decode batch of 17-32 tokens is one token tile of 32: a program decodes its weight tile once for all
    of the slot's tokens (two tiles of 16 would decode it twice, and decoding, not the dots, binds these calls)."""
    if not on_gpu:
        return dict(BLOCK_T=16, BLOCK_R=32, BLOCK_K=32, num_warps=4, BLOCK_S=16, BLOCK_L=32)
    if dense:
        return dict(BLOCK_T=32 if 16 < N <= 32 else 16, BLOCK_R=64, BLOCK_K=128, num_warps=4, num_stages=3,
                    BLOCK_S=16, BLOCK_L=256)
    # prefill: the fastest shape of a sweep on the H100 at small's shapes (docs/benchmarks.md)
    return dict(BLOCK_T=128, BLOCK_R=64, BLOCK_K=64, num_warps=4, num_stages=3, BLOCK_S=16, BLOCK_L=256)


def _launch_mlp(z, w, s, experts, routing, beta_gate, beta_up, L, I, dense: bool | None = None,
                max_pairs: int = 0) -> torch.Tensor:
    """The three passes; ``experts`` None means slot j is storage row j (the FP8 workspace)."""
    N, m = z.shape[0], routing.shape[0]
    if N == 0 or m == 0:
        return torch.zeros(N, L, dtype=torch.float32, device=z.device)
    out = torch.empty(N, L, dtype=torch.float32, device=z.device)  # the combine writes every element
    on_gpu = z.is_cuda
    if dense is None:
        fits = N <= DENSE_MAX_TOKENS and m * N * (I + L) * 4 <= DENSE_PAIR_BYTES
        dense = N <= _config(on_gpu, True, N)["BLOCK_T"] or fits
    cfg = _config(on_gpu, dense, N)
    # bf16 z (a bf16 model's activations) is read as it is: every value is exact in bf16, so the up pass's
    # tensor-core products need no low half of z (one bf16 dot per plane instead of two)
    z_bf16 = z.dtype == torch.bfloat16
    z, routing = (z if z_bf16 else z.float()).contiguous(), routing.float().contiguous()
    if dense:
        rank = count = offset = token = tile_end = routing  # unused pointers
        pairs = m * N
        tiles = triton.cdiv(N, cfg["BLOCK_T"])  # per slot (grid axis 2)
    else:
        rank, count, offset, token, tile_end, pairs, tiles = compact_lists(routing, cfg["BLOCK_T"], max_pairs)
        if pairs == 0:  # no token routed anywhere
            return out.zero_()
    h = torch.empty(pairs, I, dtype=torch.float32, device=z.device)
    part = torch.empty(pairs, L, dtype=torch.float32, device=z.device)
    shared = (w, s, routing if experts is None else experts.contiguous(), routing, count, offset, token, tile_end)
    strides = (m, N, L, I, w.stride(0), w.stride(1), s.stride(0), s.stride(1))
    # BLOCK_M, the tile list's search width, is 1 where the dense layout ignores it: a decode batch's slot count
    # (min(N * top_k, E)) then compiles no new variant
    meta = dict(MXFP4=w.dtype == torch.uint8, HAS_MAP=experts is not None, DENSE=dense, DOTS=2 if on_gpu else 0,
                BLOCK_M=1 if dense else triton.next_power_of_2(m), BLOCK_T=cfg["BLOCK_T"], BLOCK_R=cfg["BLOCK_R"],
                BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"])
    if on_gpu:
        meta["num_stages"] = cfg["num_stages"]
    # matrix-vector products for one token (MXFP4: up to MXFP4_GEMV_MAX_TOKENS), tensor-core tiles above
    meta["GEMV"] = dense and (N == 1 or (w.dtype == torch.uint8 and N <= MXFP4_GEMV_MAX_TOKENS))
    meta["PTX"] = on_gpu and triton.runtime.driver.active.get_current_target().backend == "cuda"
    # dense: token tiles per slot (the MXFP4 matrix-vector programs walk all of a slot's tokens themselves) x
    # slots; compact: the tile list's bound on one axis
    tiles = 1 if meta["GEMV"] and meta["MXFP4"] else tiles
    slots = m if dense else 1
    meta, parts_up, parts_down = gemv_meta(meta, on_gpu, L, I, m)
    up_meta = dict(meta, DOTS=(1 if z_bf16 else 2) if on_gpu else 0)
    _up_kernel[(tiles, triton.cdiv(I, meta["BLOCK_R"]), slots)](z, *shared, h, *strides, float(beta_gate),
                                                                float(beta_up), **up_meta, **parts_up)
    _down_kernel[(tiles, triton.cdiv(L, meta["BLOCK_R"]), slots)](h, *shared, part, *strides, **meta, **parts_down)
    _combine_kernel[(N, triton.cdiv(L, cfg["BLOCK_L"]))](part, routing, rank, offset, out, m, N, L, DENSE=dense,
                                                         BLOCK_S=cfg["BLOCK_S"], BLOCK_L=cfg["BLOCK_L"])
    return out


def expert_mlp_fp8(z: torch.Tensor, elements: torch.Tensor, scales: torch.Tensor, routing: torch.Tensor,
                   beta_gate: float, beta_up: float, max_pairs: int = 0) -> torch.Tensor:
    """Routed-expert MLPs over the FP8 workspace slots: z [N, L], elements float8_e4m3fn [cap, 3, I*L],
    scales uint8 [cap, 3, I*L/32], routing [m, N] (0 = not routed) -> y_lat [N, L] fp32."""
    N, L, I, m = check_fp8_mlp(z, elements, scales, routing)
    if torch.float64 in (z.dtype, routing.dtype):
        return expert_mlp_fp8_ref(z, elements, scales, routing, beta_gate, beta_up)
    require_rows_contiguous("elements", elements)
    require_rows_contiguous("scales", scales)
    return _launch_mlp(z, elements, scales, None, routing, beta_gate, beta_up, L, I, max_pairs=max_pairs)


def expert_mlp_mxfp4(z: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                     routing: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    """Routed-expert MLPs straight from MXFP4 storage: z [N, L], packed uint8 [E, 3, I*L/2], scales uint8
    [E, 3, I*L/32], experts integer [m] (slot j = expert experts[j]), routing [m, N] -> y_lat [N, L] fp32."""
    N, L, I, m = check_mxfp4_mlp(z, packed, scales, experts, routing)
    if torch.float64 in (z.dtype, routing.dtype):
        return expert_mlp_mxfp4_ref(z, packed, scales, experts, routing, beta_gate, beta_up)
    require_rows_contiguous("packed", packed)
    require_rows_contiguous("scales", scales)
    return _launch_mlp(z, packed, scales, experts, routing, beta_gate, beta_up, L, I)
