"""Decode path of the routed-expert MLPs (docs/design.md §6, §7, §12): matrix-vector products on the FMA
units, run by the up and down kernels of ``mlp_triton.py`` in the dense pair layout (FP8: one token;
MXFP4: every decode size). Unlike a tensor-core pass this pads no token lane to tl.dot's 16 and splits no
activation into bf16 halves: every product is exact in fp32, so the result equals the reference's
(``reference.py``) to fp32 rounding (the order of the sums, tanh built from exp).

FP8, one token (``gemv_rows``): a program streams BLOCK_R weight rows in BLOCK_K steps and accumulates
weight x activation products elementwise in fp32 ([BLOCK_R, BLOCK_K] in registers, reduced along K at the
end). Bound by weight bytes: ~60 % of the H200's 4.3 TB/s at K3 shapes.

MXFP4, every decode size (``_mxfp4_rows``): a program (BLOCK_R rows of one slot) walks the slot's routed
tokens; per token it computes its rows, RB at a time, each over the whole K.
- A thread owns whole scale groups of K (32 codes, 4 int32 words; or half groups, see below). It loads
  their activations once per (program, token) as 8 planes x[j::8] (h is stored that way, z gathered),
  and keeps them in registers; per row it then issues one 16-byte load per group of codes. No activation
  is reloaded per row, and every weight byte is read once, as part of a vector load.
- A word's 8 codes are decoded by ``dequant_triton.E2M1_PTX`` (11 integer instructions per 8 codes, then one
  fp16 -> fp32 widening per code) into one fp32 FMA chain; each group's sum is scaled once, not each
  product, and one reduction across the threads ends the row.
- The row loop is software-pipelined by the compiler (``num_stages``: asynchronous copies of the next
  rows' words). The group scales are uint8, which the compiler does not prefetch, so they are loaded a
  step ahead by hand; the up pass's SiTU-GLU runs once on all the program's rows after the loop, not once
  per step.
- No thread idles on padding: K is cut into power-of-two parts (``_k_parts``: K3's 3584 = 64 + 32 groups
  + 16 groups as 32 half-group units; 3072 = 64 + 32). One power-of-two tile would mask 12.5 % (3584) or
  25 % (3072) of every warp instruction's lanes in a loop bound by instruction issue.
- A slot routed by several tokens is decoded once per token (the second read of its rows can hit L2).
  Decoding a row once for two tokens would double the activations a thread holds, and the registers,
  lost occupancy and per-row reductions cost more than the decode saved.
Bound by instruction issue (decode, FMA, per-row reduction, scale, SiTU-GLU): ~53-60 % of the H200's
4.3 TB/s on MXFP4 bytes at K3 shapes (top-16 of 896 experts, 1-16 tokens).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..activation.situ_glu_triton import situ_glu_tl
from .dequant_triton import E2M1_PTX, e2m1_fp16, e8m0, group_scales, weight_tile

# Decode tiles of the matrix-vector path: FP8 (one token): rows per program, K per step, warps; MXFP4
# (every decode size): a program computes BLOCK_R rows, RB at a time, each over the whole K (see
# _mxfp4_rows). MXFP4 on the GPU: one warp of 16 rows, one row per step; the activations a program loads
# per token serve all 16 rows (32 rows, 2 rows per step or two warps measured slower on the H200).
GEMV_TILES = {"cuda": dict(BLOCK_R=8, BLOCK_K=256, num_warps=4), "cuda_mxfp4": dict(BLOCK_R=16, RB=1, num_warps=1),
              "cpu": dict(BLOCK_R=16, BLOCK_K=32, num_warps=1),
              # the interpreter pays per operation: few wide steps; the tests' L and I still leave tails
              "cpu_mxfp4": dict(BLOCK_R=128, RB=64, num_warps=1)}


@triton.jit
def gemv_rows(w_ptr, s_ptr, rows, row_ok, K, x_ptr, ROWS: tl.constexpr, BK: tl.constexpr):
    """W[rows, :] @ x for one row-major [*, K] FP8 expert matrix and one activation row x [K] -> [ROWS] fp32:
    weight x activation products accumulated elementwise on the FMA units, reduced along K at the end."""
    acc = tl.zeros((ROWS, BK), tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        s = group_scales(s_ptr, rows, row_ok, K // 32, k0, ROWS, BK)
        acc += weight_tile(w_ptr, s, rows, row_ok, K, k0, ROWS, BK) * _f32(x_ptr + k, k < K)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _e2m1_code(w, J: tl.constexpr):
    """Code J of int32 words of eight E2M1 codes -> fp32 value * 2^-14 (the fp16 of dequant_triton)."""
    return e2m1_fp16(w >> (4 * J))


@triton.jit
def _words(G0, UNITS: tl.constexpr, WPU: tl.constexpr):
    """Word offsets [1, UNITS, WPU] of one part of a K row: UNITS units of WPU words from group G0."""
    return G0 * 4 + (tl.arange(0, UNITS) * WPU)[None, :, None] + tl.arange(0, WPU)[None, None, :]


@triton.jit
def _x_part(x_ptr, K, G0, UNITS: tl.constexpr, WPU: tl.constexpr, PLANAR: tl.constexpr):
    """One part of the activation row as its 8 planes x_j = x[j::8], [1, UNITS, WPU] each, zero past K; once
    per program and token. PLANAR: the row is stored as its planes ([8, K/8], as the up pass writes h), so
    each plane is a vector load; otherwise (z, as the layer passes it) each plane is a stride-8 gather from
    the 2-4 KB row, a few scalar loads per thread that cost less than a separate transposing copy."""
    wo = _words(G0, UNITS, WPU)
    ok = wo < K // 8
    if PLANAR:
        plane = K // 32 * 4  # K/8, written so that the compiler sees a multiple of 4 words (16-byte loads)
        return (tl.load(x_ptr + wo, mask=ok, other=0.0), tl.load(x_ptr + plane + wo, mask=ok, other=0.0),
                tl.load(x_ptr + 2 * plane + wo, mask=ok, other=0.0), tl.load(x_ptr + 3 * plane + wo, mask=ok, other=0.0),
                tl.load(x_ptr + 4 * plane + wo, mask=ok, other=0.0), tl.load(x_ptr + 5 * plane + wo, mask=ok, other=0.0),
                tl.load(x_ptr + 6 * plane + wo, mask=ok, other=0.0), tl.load(x_ptr + 7 * plane + wo, mask=ok, other=0.0))
    e = x_ptr + 8 * wo
    return (_f32(e, ok), _f32(e + 1, ok), _f32(e + 2, ok), _f32(e + 3, ok), _f32(e + 4, ok), _f32(e + 5, ok),
            _f32(e + 6, ok), _f32(e + 7, ok))


@triton.jit
def _f32(ptr, mask):
    """A masked load widened to fp32 (z may be bf16: the model's activations, exactly)."""
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _x_parts(x_ptr, K, GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr, PLANAR: tl.constexpr):
    """The activation planes of the three parts of K (see _mxfp4_rows); an absent part repeats part A."""
    xa = _x_part(x_ptr, K, 0, GA, 4, PLANAR)
    xb = xa
    xc = xa
    if GB > 0:
        xb = _x_part(x_ptr, K, GA, GB, 4, PLANAR)
    if HC > 0:
        xc = _x_part(x_ptr, K, GA + GB, HC, 2, PLANAR)
    return xa, xb, xc


@triton.jit
def _part_scales(s_ptr, rows, row_ok, K, G0, UNITS: tl.constexpr, WPU: tl.constexpr):
    """The E8M0 scales of a part's units for rows ``rows`` of one [*, K] matrix, uint8 [RB, UNITS] (a
    half-group unit repeats its group's scale; 127 = 1 past K)."""
    g = G0 + tl.arange(0, UNITS) * WPU // 4
    return tl.load(s_ptr + rows[:, None] * (K // 32) + g[None, :], mask=row_ok[:, None] & (g < K // 32)[None, :],
                   other=127)


@triton.jit
def _row_scales(s_ptr, rows, row_ok, K, GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr):
    """(part A, part B, part C) scales of rows ``rows``; an absent part repeats part A."""
    sa = _part_scales(s_ptr, rows, row_ok, K, 0, GA, 4)
    sb = sa
    sc = sa
    if GB > 0:
        sb = _part_scales(s_ptr, rows, row_ok, K, GA, GB, 4)
    if HC > 0:
        sc = _part_scales(s_ptr, rows, row_ok, K, GA + GB, HC, 2)
    return sa, sb, sc


@triton.jit
def _part_dot(w_ptr, s, rows, row_ok, K, G0, x, UNITS: tl.constexpr, WPU: tl.constexpr, TAIL: tl.constexpr,
              PTX: tl.constexpr):
    """W[rows, part] @ x[part] -> [RB] fp32 for one part of a row-major [*, K] MXFP4 matrix. The codes are
    read as int32 words, [RB, UNITS, WPU]: a thread holds whole units (one vector load each). Each word's
    eight products are summed in one fp32 FMA chain (unscaled values times x), the unit's scale multiplies
    the unit's sum once, and a reduction across the units (threads) ends the part. The products are exact
    (fp16 -> fp32 widening, fp32 x). Only the tail part (TAIL) masks words past K."""
    words = w_ptr.to(tl.pointer_type(tl.int32))
    wo = _words(G0, UNITS, WPU)
    mask = row_ok[:, None, None]
    if TAIL:
        mask = mask & (wo < K // 8)
    w = tl.load(words + rows[:, None, None] * (K // 32 * 4) + wo, mask=mask, other=0)
    if PTX:
        c = tl.inline_asm_elementwise(E2M1_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8,
                                      is_pure=True, pack=1)
    else:
        c = (_e2m1_code(w, 0), _e2m1_code(w, 1), _e2m1_code(w, 2), _e2m1_code(w, 3),
             _e2m1_code(w, 4), _e2m1_code(w, 5), _e2m1_code(w, 6), _e2m1_code(w, 7))
    p = c[0] * x[0]  # one fp32 FMA chain per word
    p += c[1] * x[1]
    p += c[2] * x[2]
    p += c[3] * x[3]
    p += c[4] * x[4]
    p += c[5] * x[5]
    p += c[6] * x[6]
    p += c[7] * x[7]
    return tl.sum(p, axis=2) * e8m0(s, 14)


@triton.jit
def _fold(v, UNITS: tl.constexpr, M: tl.constexpr):
    """[RB, UNITS] -> [RB, M] (M divides UNITS): unit u is added into u % M."""
    if UNITS == M:
        return v
    return tl.sum(tl.reshape(v, [v.shape[0], UNITS // M, M]), axis=1)


@triton.jit
def _mxfp4_rows(w_ptr, s, rows, row_ok, K, x, GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr,
                PTX: tl.constexpr):
    """W[rows, :] @ x for one row-major [*, K] MXFP4 expert matrix (K a multiple of 32) -> [RB] fp32, with x
    and s the tuples of _x_parts and _row_scales.

    K is cut into parts whose sizes are powers of two, so that no thread of the warp idles on padding: part
    A holds the first GA groups (2^a, the largest that fits), part B the next GB (the next bit of the group
    count, or 0), and part C the remaining groups as HC half-group units of 2 words (padded to a power of
    two and masked). K = 3584 (112 groups) is 64 + 32 + 16 groups, 14 words per thread of a warp, where
    a single padded [128 groups] tile would give every thread 16 (12.5 % of them masked; 25 % for
    K = 3072)."""
    M: tl.constexpr = min(GA, GB if GB > 0 else GA, HC if HC > 0 else GA)
    acc = _fold(_part_dot(w_ptr, s[0], rows, row_ok, K, 0, x[0], GA, 4, False, PTX), GA, M)
    if GB > 0:
        acc += _fold(_part_dot(w_ptr, s[1], rows, row_ok, K, GA, x[1], GB, 4, False, PTX), GB, M)
    if HC > 0:
        acc += _fold(_part_dot(w_ptr, s[2], rows, row_ok, K, GA + GB, x[2], HC, 2, True, PTX), HC, M)
    return tl.sum(acc, axis=1)


@triton.jit
def _up_token(z_ptr, w1, s1, sw_m, ss_m, h_ptr, pair, t, gate, L, I, beta_gate, beta_up,
              BLOCK_R: tl.constexpr, RB: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr,
              PTX: tl.constexpr):
    """h[pair, rows] of the program's BLOCK_R rows for one routed token t (decode, MXFP4).

    The row loop only collects the rows' two sums; SiTU-GLU then runs once on all BLOCK_R rows (inside
    the loop its ~100 instructions would run per step for one row's value), and each step's group scales are
    loaded a step ahead (uint8 loads are not prefetched by the compiler)."""
    x = _x_parts(z_ptr + t * L, L, GA, GB, HC, False)
    row0 = tl.program_id(1) * BLOCK_R
    steps = tl.arange(0, BLOCK_R // RB)
    g_rows = tl.zeros([BLOCK_R // RB, RB], tl.float32)
    u_rows = tl.zeros([BLOCK_R // RB, RB], tl.float32)
    rb = row0 + tl.arange(0, RB)
    sg, su = _row_scales(s1, rb, rb < I, L, GA, GB, HC), _row_scales(s1 + ss_m, rb, rb < I, L, GA, GB, HC)
    for r0 in tl.range(0, BLOCK_R, RB, num_stages=3):  # the compiler prefetches the weight words
        rb = row0 + r0 + tl.arange(0, RB)
        ok = rb < I
        nxt = rb + RB
        sg_next = _row_scales(s1, nxt, nxt < I, L, GA, GB, HC)
        su_next = _row_scales(s1 + ss_m, nxt, nxt < I, L, GA, GB, HC)
        here = (steps == r0 // RB)[:, None]
        g_rows = tl.where(here, _mxfp4_rows(w1, sg, rb, ok, L, x, GA, GB, HC, PTX)[None, :], g_rows)
        u_rows = tl.where(here, _mxfp4_rows(w1 + sw_m, su, rb, ok, L, x, GA, GB, HC, PTX)[None, :], u_rows)
        sg, su = sg_next, su_next
    rows = row0 + tl.arange(0, BLOCK_R)
    h = situ_glu_tl(tl.reshape(g_rows, [BLOCK_R]), tl.reshape(u_rows, [BLOCK_R]), beta_gate, beta_up) * gate
    tl.store(h_ptr + pair * I + (rows % 8) * (I // 8) + rows // 8, h, mask=rows < I)  # 8 planes h[j::8]


@triton.jit
def _down_token(h_ptr, w2, s2, part_ptr, pair, L, I, BLOCK_R: tl.constexpr, RB: tl.constexpr,
                GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr, PTX: tl.constexpr):
    """part[pair, rows] of the program's BLOCK_R latent rows for one routed (slot, token) pair (group
    scales loaded a step ahead, as in _up_token)."""
    x = _x_parts(h_ptr + pair * I, I, GA, GB, HC, True)
    row0 = tl.program_id(1) * BLOCK_R
    rb = row0 + tl.arange(0, RB)
    sc = _row_scales(s2, rb, rb < L, I, GA, GB, HC)
    for r0 in tl.range(0, BLOCK_R, RB, num_stages=3):
        rb = row0 + r0 + tl.arange(0, RB)
        ok = rb < L
        nxt = rb + RB
        sc_next = _row_scales(s2, nxt, nxt < L, I, GA, GB, HC)
        tl.store(part_ptr + pair * L + rb, _mxfp4_rows(w2, sc, rb, ok, I, x, GA, GB, HC, PTX), mask=ok)
        sc = sc_next


@triton.jit
def up_decode(z_ptr, w1, s1, sw_m, ss_m, routing_ptr, h_ptr, slot, N, L, I, beta_gate, beta_up,
               BLOCK_R: tl.constexpr, RB: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr,
               PTX: tl.constexpr):
    """The up pass at decode (MXFP4): each of the slot's routed tokens on its own (a second token's read
    of the rows can hit L2)."""
    for t in range(N):
        gate = tl.load(routing_ptr + slot * N + t).to(tl.float32)
        if gate != 0.0:
            _up_token(z_ptr, w1, s1, sw_m, ss_m, h_ptr, slot.to(tl.int64) * N + t, t, gate, L, I, beta_gate, beta_up,
                      BLOCK_R, RB, GA, GB, HC, PTX)


@triton.jit
def down_decode(h_ptr, w2, s2, routing_ptr, part_ptr, slot, N, L, I, BLOCK_R: tl.constexpr, RB: tl.constexpr,
                 GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr, PTX: tl.constexpr):
    """The down pass at decode (MXFP4), over the slot's routed tokens like up_decode."""
    for t in range(N):
        if tl.load(routing_ptr + slot * N + t).to(tl.float32) != 0.0:
            _down_token(h_ptr, w2, s2, part_ptr, slot.to(tl.int64) * N + t, L, I, BLOCK_R, RB, GA, GB, HC, PTX)


def _k_parts(K: int) -> dict:
    """(GA, GB, HC) of _mxfp4_rows for a K of K // 32 scale groups: the two highest bits of the group count,
    then what is left as a power-of-two count of half-group units (3584 -> 64 + 32 groups + 32 half groups,
    3072 -> 64 + 32 + 0)."""
    groups = K // 32
    ga = 1 << (groups.bit_length() - 1)
    rest = groups - ga
    gb = 1 << (rest.bit_length() - 1) if rest else 0
    rem = rest - gb
    return dict(GA=ga, GB=gb, HC=triton.next_power_of_2(2 * rem) if rem else 0)


# A GPU launch of fewer programs than this leaves SMs idle: the MXFP4 row block shrinks (16 -> 8 -> 4 rows)
# until the grid reaches it. 8 slots of 512 rows in blocks of 16 would be 256 one-warp programs, each
# walking 16 dependent row steps while most SMs hold one warp or none.
GEMV_MIN_PROGRAMS = 1024


def gemv_meta(meta: dict, on_gpu: bool, L: int, I: int, m: int = 1) -> tuple[dict, dict, dict]:
    """The launch constexprs with the matrix-vector tiles, and the up and down passes' K parts (MXFP4
    decode only; GA = 1 elsewhere, so each model shape compiles one variant). ``m``: slots in the grid."""
    gemv, mxfp4 = meta["GEMV"], meta["MXFP4"]
    if gemv:  # matrix-vector products on the FMA units
        meta = dict(meta, **GEMV_TILES[("cuda" if on_gpu else "cpu") + ("_mxfp4" if mxfp4 else "")])
        meta.setdefault("BLOCK_K", 32)
        if on_gpu and mxfp4:
            while meta["BLOCK_R"] > 4 and m * triton.cdiv(min(L, I), meta["BLOCK_R"]) < GEMV_MIN_PROGRAMS:
                meta["BLOCK_R"] //= 2
    meta.setdefault("RB", 1)
    if not (gemv and mxfp4):
        none = dict(GA=1, GB=0, HC=0)
        return meta, none, none
    return meta, _k_parts(L), _k_parts(I)
