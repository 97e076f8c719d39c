"""In-register dequantisation of routed-expert weight tiles, shared by the tensor-core passes of
``mlp_triton.py`` and the FP8 matrix-vector product of ``matvec_triton.py``. Every weight value is the
reference's value exactly (``reference.py``).

FP8: the e4m3 byte converts to fp32 (hardware cvt on the GPU) and is multiplied by its group scale
2^(s-127), built from the E8M0 byte as fp32 exponent bits (no exp2 call). MXFP4: the packed byte splits
into the even (low) and odd (high) nibble, ``tl.join`` + reshape interleaves them into element order, and
the E2M1 code's 3 magnitude bits are placed in fp16's exponent/mantissa (``(c & 7) << 9``, sign at bit
15): that fp16 is the E2M1 value times 2^-14 (0.5 lands on an fp16 subnormal, which every conversion
keeps exact), so one multiply by 2^(s-127+14) gives the weight. The decode path's PTX
(``matvec_triton._E2M1_PTX``) builds the same fp16.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e8m0(s, SHIFT: tl.constexpr):
    """uint8 E8M0 codes -> fp32 2^(s - 127 + SHIFT), built as exponent bits (exact, no exp2 call)."""
    s = s.to(tl.int32)
    e = s + SHIFT
    bits = tl.where(e > 0, e << 23, 0x00400000)  # e == 0 only for SHIFT 0, s 0: 2^-127 (an fp32 subnormal)
    bits = tl.where(e > 254, 0x7F800000, bits)  # past fp32 (codes a checkpoint load rejects): inf
    bits = tl.where(s == 255, 0x7FC00000, bits)  # the E8M0 NaN code stays NaN, as in the reference
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _group_scales(s_ptr, rows, row_ok, KG, k0, ROWS: tl.constexpr, BK: tl.constexpr):
    """uint8 E8M0 codes [ROWS, BK // 32] of a tile's groups (groups of 32 along K, rows x KG scales);
    127 (a factor of 1) past K, so a tile loaded a step ahead of the last one reads nothing."""
    g = k0 // 32 + tl.arange(0, BK // 32)
    return tl.load(s_ptr + rows[:, None] * KG + g[None, :], mask=row_ok[:, None] & (g < KG)[None, :], other=127)


@triton.jit
def _scaled(v, s, SHIFT: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    """v [ROWS, BK] element values times their group scales s (codes [ROWS, BK // 32])."""
    return tl.reshape(tl.reshape(v, (ROWS, BK // 32, 32)) * _e8m0(s, SHIFT)[:, :, None], (ROWS, BK))


@triton.jit
def _weight_tile_pre(w_ptr, s, rows, row_ok, K, k0, MXFP4: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    """fp32 [ROWS, BK] tile (rows ``rows``, columns k0..k0+BK) of one row-major [*, K] expert matrix, with
    its group scales s already loaded (``_group_scales``): a loop loads the next tile's a step ahead,
    because the compiler's pipelining does not prefetch these few-byte uint8 loads."""
    if MXFP4:
        c = k0 // 2 + tl.arange(0, BK // 2)
        ok = row_ok[:, None] & (c < K // 2)[None, :]
        b = tl.load(w_ptr + rows[:, None] * (K // 2) + c[None, :], mask=ok, other=0).to(tl.int32)
        codes = tl.reshape(tl.join(b & 0x0F, b >> 4), (ROWS, BK))  # low nibble = even element
        bits = ((codes & 7) << 9) | ((codes & 8) << 12)  # fp16 holding the E2M1 value * 2^-14
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return _scaled(v, s, 14, ROWS, BK)
    else:
        k = k0 + tl.arange(0, BK)
        ok = row_ok[:, None] & (k < K)[None, :]
        v = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=ok, other=0.0).to(tl.float32)
        return _scaled(v, s, 0, ROWS, BK)


@triton.jit
def _weight_tile(w_ptr, s_ptr, rows, row_ok, K, k0, MXFP4: tl.constexpr, ROWS: tl.constexpr,
                 BK: tl.constexpr):
    """fp32 [ROWS, BK] tile (rows ``rows``, columns k0..k0+BK) of one row-major [*, K] expert matrix."""
    return _weight_tile_pre(w_ptr, _group_scales(s_ptr, rows, row_ok, K // 32, k0, ROWS, BK), rows, row_ok, K, k0,
                            MXFP4, ROWS, BK)
