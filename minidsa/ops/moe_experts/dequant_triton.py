"""In-register dequantisation of routed-expert weights, shared by the tensor-core passes of
``mlp_triton.py`` and the matrix-vector products of ``matvec_triton.py``. Every weight value is the
reference's value exactly (``reference.py``).

FP8: the e4m3 byte converts to fp32 (hardware cvt on the GPU) and is multiplied by its group scale
2^(s-127), built from the E8M0 byte as fp32 exponent bits (no exp2 call). MXFP4: each E2M1 code's 3
magnitude bits are placed in fp16's exponent/mantissa (``(c & 7) << 9``, sign at bit 15): that fp16 is the
E2M1 value times 2^-14 (0.5 lands on an fp16 subnormal, which every conversion keeps exact), so one
multiply by 2^(s-127+14) gives the weight. On the GPU the matrix-vector path builds those fp16s with the
PTX below, a 32-bit word of eight codes at a time; the tiles' PTX looks the bf16 values up instead and
scales them in bf16 (bf16 has fp32's exponent range, and a 2-bit mantissa times a power of two is exact).

A tensor-core tile is used as two *planes*, its even and its odd elements along K: a packed byte holds one
element of each (low nibble = even), so the two planes decode from the bytes in place, where putting the
elements back in order would cost a shuffle of every register (the product W @ x then sums the planes'
products: W[:, 0::2] @ x[0::2] + W[:, 1::2] @ x[1::2]). FP8 tiles need no planes (their bytes are their
elements): ``weight_tile`` gives them whole.
"""

from __future__ import annotations

import triton
import triton.language as tl

# E2M1 -> fp16 in PTX, for one 32-bit word of eight codes (code j in bits 4j..4j+3). Each code becomes the
# high byte [sign 000 mag 0] of an fp16 whose low byte is 0, i.e. the fp16 with the code's magnitude bits at
# 9..11 and its sign at 15: the E2M1 value times 2^-14, exactly. Even codes: (w << 1) & 0x0E (magnitude) |
# (w << 4) & 0x80 (sign) per byte; odd codes: (w >> 3) & 0x0E | w & 0x80. One prmt then places two of those
# bytes as the high bytes of an fp16 pair (its selector's 4s read the zero register), and a cvt per code
# widens it to fp32 (HADD2.F32 in SASS): 11 integer instructions per 8 codes, where a nibble split, join
# and shift cost several per code. h0..h7 are codes 0..7; the two programs differ only in where they go.
_E2M1_BODY = """
.reg .b32 t, u, e, o, p0, p1, p2, p3;
.reg .b16 h0, h1, h2, h3, h4, h5, h6, h7;
shl.b32 t, $8, 1;
shl.b32 u, $8, 4;
and.b32 t, t, 0x0E0E0E0E;
and.b32 u, u, 0x80808080;
or.b32 e, t, u;
shr.b32 t, $8, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 u, $8, 0x80808080;
or.b32 o, t, u;
prmt.b32 p0, e, 0, 0x1404;
prmt.b32 p1, e, 0, 0x3424;
prmt.b32 p2, o, 0, 0x1404;
prmt.b32 p3, o, 0, 0x3424;
mov.b32 {h0, h2}, p0;
mov.b32 {h4, h6}, p1;
mov.b32 {h1, h3}, p2;
mov.b32 {h5, h7}, p3;
"""
_cvt = "".join
# Element order ($0..$7 = codes 0..7), for an int32 word: the matrix-vector path.
E2M1_PTX = tl.constexpr("{" + _E2M1_BODY + _cvt(f"cvt.f32.f16 ${j}, h{j};\n" for j in range(8)) + "}")
# E2M1 -> scaled bf16 planes in PTX, for four packed bytes (inline asm with pack=4 over uint8: the four bytes
# arrive as one register $4, byte i = elements 2i (low nibble) and 2i+1) and their four bf16 group scales
# ($5, $6: two pairs). Out: the even elements' bf16 pairs ($0: bytes 0, 1; $1: bytes 2, 3), then the odd
# ones' ($2, $3). The magnitude is a table lookup: prmt selects, per nibble, a byte of an 8-byte pool, so
# the low and the high bytes of the eight bf16 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6: 0x0000, 0x3F00,
# 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0) are two pools, and four prmts decode eight codes'
# bytes. prmt's sign-replicating selectors (bit 3 set) turn the codes' sign bits into 0xFF bytes: the
# even codes' signs are the byte msbs of w << 4, the odd codes' those of w. Four prmts then pair the bytes
# into bf16s, and one bf16x2 fma (times the scale, plus -0 so that -0 stays -0) per pair scales them,
# exactly (a 2-bit mantissa times a power of two). 15 integer instructions and 4 fmas per 8 codes.
_E2M1_PLANES_PTX = tl.constexpr("""
{
.reg .b32 t, v, m, l0, l1, h0, h1, a, b, c, d, sb, sd;
mov.b32 l0, 0xC0800000;
mov.b32 l1, 0xC0804000;
mov.b32 h0, 0x3F3F3F00;
mov.b32 h1, 0x40404040;
mov.b32 m, 0x80008000;
and.b32 t, $4, 0x77777777;
prmt.b32 a, l0, l1, t;
prmt.b32 b, h0, h1, t;
shr.b32 t, t, 16;
prmt.b32 c, l0, l1, t;
prmt.b32 d, h0, h1, t;
shl.b32 v, $4, 4;
prmt.b32 sb, v, $4, 0xD948;
prmt.b32 sd, v, $4, 0xFBEA;
and.b32 sb, sb, 0x80808080;
and.b32 sd, sd, 0x80808080;
or.b32 b, b, sb;
or.b32 d, d, sd;
prmt.b32 t, a, b, 0x6240;
fma.rn.bf16x2 $0, t, $5, m;
prmt.b32 t, c, d, 0x6240;
fma.rn.bf16x2 $1, t, $6, m;
prmt.b32 t, a, b, 0x7351;
fma.rn.bf16x2 $2, t, $5, m;
prmt.b32 t, c, d, 0x7351;
fma.rn.bf16x2 $3, t, $6, m;
}
""")


@triton.jit
def e8m0(s, SHIFT: tl.constexpr):
    """uint8 E8M0 codes -> fp32 2^(s - 127 + SHIFT), built as exponent bits (exact, no exp2 call)."""
    s = s.to(tl.int32)
    e = s + SHIFT
    bits = tl.where(e > 0, e << 23, 0x00400000)  # e == 0 only for SHIFT 0, s 0: 2^-127 (an fp32 subnormal)
    bits = tl.where(e > 254, 0x7F800000, bits)  # past fp32 (codes a checkpoint load rejects): inf
    bits = tl.where(s == 255, 0x7FC00000, bits)  # the E8M0 NaN code stays NaN, as in the reference
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_bf16(s):
    """uint8 E8M0 codes -> bf16 2^(s - 127), exactly: bf16 has fp32's exponent range (code 0 is the subnormal
    2^-127; 255, NaN, stays NaN)."""
    s = s.to(tl.int32)
    bits = tl.where(s == 0, 0x0040, tl.where(s == 255, 0x7FC0, s << 7))
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_fp16(c):
    """int32 E2M1 codes (low 4 bits) -> fp32 value * 2^-14 (the fp16 of the module docstring)."""
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def group_scales(s_ptr, rows, row_ok, KG, k0, ROWS: tl.constexpr, BK: tl.constexpr):
    """uint8 E8M0 codes [ROWS, BK // 32] of a tile's groups (groups of 32 along K, rows x KG scales);
    127 (a factor of 1) past K, so a tile loaded a step ahead of the last one reads nothing."""
    g = k0 // 32 + tl.arange(0, BK // 32)
    return tl.load(s_ptr + rows[:, None] * KG + g[None, :], mask=row_ok[:, None] & (g < KG)[None, :], other=127)


@triton.jit
def _scaled(v, s, SHIFT: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    """One plane v [ROWS, BK // 2] of an MXFP4 tile times its group scales s (codes [ROWS, BK // 32]): 16 plane
    elements per group."""
    return tl.reshape(tl.reshape(v, (ROWS, BK // 32, 16)) * e8m0(s, SHIFT)[:, :, None], (ROWS, BK // 2))


@triton.jit
def weight_planes(w_ptr, s, rows, row_ok, K, k0, PTX: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    """The (even, odd) planes, [ROWS, BK // 2] each (fp32; bf16 from the PTX), of the MXFP4 tile at rows ``rows``,
    columns k0..k0+BK of one row-major [*, K] expert matrix (K a multiple of 32), with its group scales s already
    loaded (``group_scales``): a loop loads the next tile's a step ahead, because the compiler's pipelining does
    not prefetch these few-byte uint8 loads. PTX: decode with _E2M1_PLANES_PTX (the GPU; its bf16 values are the
    fp32 ones exactly, which the tensor-core products take as bf16 anyway)."""
    c = k0 // 2 + tl.arange(0, BK // 2)
    row_bytes = K // 32 * 16  # K / 2, written so that the compiler sees a multiple of 16 (vector loads)
    ok = row_ok[:, None] & (c < row_bytes)[None, :]
    b = tl.load(w_ptr + rows[:, None] * row_bytes + c[None, :], mask=ok, other=0)
    if PTX:  # bf16 planes, scaled in the PTX (16 bytes, 32 elements, per group)
        b = tl.reshape(b, (ROWS, BK // 32, 16))
        sc = tl.broadcast_to(_e8m0_bf16(s)[:, :, None], (ROWS, BK // 32, 16))
        even, odd = tl.inline_asm_elementwise(_E2M1_PLANES_PTX, "=r,=r,=r,=r,r,r,r", [b, sc],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        even, odd = tl.reshape(even, (ROWS, BK // 2)), tl.reshape(odd, (ROWS, BK // 2))
    else:
        b = b.to(tl.int32)
        even, odd = _scaled(e2m1_fp16(b), s, 14, ROWS, BK), _scaled(e2m1_fp16(b >> 4), s, 14, ROWS, BK)
    return even, odd


@triton.jit
def weight_tile(w_ptr, s, rows, row_ok, K, k0, ROWS: tl.constexpr, BK: tl.constexpr):
    """fp32 [ROWS, BK] tile (rows ``rows``, columns k0..k0+BK) of one row-major [*, K] FP8 expert matrix, in
    element order, times its group scales s (``group_scales``). An FP8 tile needs no planes: its bytes are its
    elements, so a tensor-core pass takes it in one K-wide product."""
    k = k0 + tl.arange(0, BK)
    ok = row_ok[:, None] & (k < K)[None, :]
    v = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=ok, other=0.0).to(tl.float32)
    return tl.reshape(tl.reshape(v, (ROWS, BK // 32, 32)) * e8m0(s, 0)[:, :, None], (ROWS, BK))
