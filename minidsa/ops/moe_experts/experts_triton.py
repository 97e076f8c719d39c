"""Triton kernels of the routed latent experts (docs/design.md §6, §7, §12): MXFP4 -> FP8 conversion into
the shared workspace, and the routed-expert MLPs over the FP8 workspace or straight from MXFP4.
Same signatures and results as ``minidsa/ops/moe_experts/reference.py``.

**Conversion** (``mxfp4_to_fp8``). Grid ``(chunk of BLOCK words, slot)``; slot j reads expert
``experts[j]``. An expert's w1, w3, w2 codes are one contiguous block, read as uint16 words (two packed
bytes, four codes). Each code becomes its e4m3 byte by integer arithmetic (magnitude code 0 -> 0x00,
1 (0.5) -> 0x30, c >= 2 -> 0x30 + 4c; the sign bit moves from bit 3 to bit 7), and the four bytes of a
word are written as one int32, in element order (little-endian, as on every GPU and x86 CPU). The
word's E8M0 scales (one per 8 words) are copied alongside. Measured on the H200 (bench_moe.py), the
word version moves 71 % of 4.3 TB/s where a byte in / int16 out version peaked at 54 %: half the load
and store instructions for the same bytes. Bytes moved per expert, with I*L elements per matrix:
read 3*I*L/2 + 3*I*L/32, write 3*I*L + 3*I*L/32 (51.6 MB at K3's L = 3584, I = 3072).

**Expert MLPs** (``expert_mlp_fp8``, ``expert_mlp_mxfp4``). Three launches, grouped over all slots,
no Python loop over experts and no atomics:

1. *up*: grid ``(token tile, block of BLOCK_R rows of I, slot)``. A program walks L in BLOCK_K steps,
   dequantises a [BLOCK_R, BLOCK_K] tile of w1 and of w3 in registers, and accumulates
   ``g, u [BLOCK_R, BLOCK_T] += W @ z^T`` in fp32 (weights are the dot's M: 64-128 rows; a token tile
   short of BLOCK_T is padded by masked lanes; decode steps take the *Decode* path below). It then
   applies SiTU-GLU and the gate and writes ``h = gate * SiTU-GLU(g, u)`` [BLOCK_T, BLOCK_R] rows.
2. *down*: grid ``(token tile, block of BLOCK_R rows of L, slot)``: ``part = h @ W2^T`` per
   (slot, token) pair, written to a per-pair buffer [pairs, L].
3. *combine*: one program per (token, BLOCK_L columns) sums its pairs' rows over the slots in a
   fixed order (a masked [BLOCK_S, BLOCK_L] gather per step, then a tree sum). The split of the
   expert sum into per-pair rows and a separate ordered reduction is what makes the result bitwise
   reproducible without atomics.

*Decode* (the dense pair layout): matrix-vector products on the FMA units instead of tensor-core
passes: no token lane padded to tl.dot's 16, no bf16 split of the activation, exact fp32 products.
- FP8, one token: a program streams BLOCK_R weight rows in BLOCK_K steps and accumulates weight x
  activation products elementwise in fp32 ([BLOCK_R, BLOCK_K] in registers, reduced along K at the
  end). 60 % of 4.3 TB/s on its weight bytes (0.209 ms for 16 slots of L=3584, I=3072).
- MXFP4, every decode size (``_mxfp4_rows``): a program (BLOCK_R rows of one slot) walks the slot's
  routed tokens; per token it computes its rows, RB at a time, each over the whole K. A thread owns
  whole scale groups of K (32 codes, 4 int32 words; or half groups, see below): it loads their
  activations once per (program, token) (passed as 8 planes x[j::8], so that each is a vector load)
  and then, per row, one 16-byte load per group of codes. A word's 8 codes are decoded by ``_E2M1_PTX``
  (11 integer instructions per 8 codes, then one fp16 -> fp32 widening per code) into one fp32 FMA
  chain, each group's sum is scaled once, and one reduction across the threads ends the row. The row
  loop is software-pipelined by the compiler (``num_stages``: asynchronous copies of the next rows'
  words); the group scales (uint8, which it does not prefetch) are loaded a step ahead by hand, and the
  up pass's SiTU-GLU runs once on all the program's rows after the loop.
  No thread idles on padding: K is cut into power-of-two parts (``_k_parts``: K3's 3584 = 64 + 32
  groups + 16 groups as 32 half-group units; 3072 = 64 + 32), where one [128-group] tile padded the
  112 and 96 groups, so that 12.5 % and 25 % of every warp instruction's lanes were masked in an
  instruction-bound loop. Measured on the H200 (one process, GPU time of CUDA-graph replays where
  marked, top-16 of 256; SASS instructions per step for the up / down pass compiled for sm_90):
    scales a step ahead + SiTU-GLU after the loop (1,192 -> 1,114 / 603, 167 -> 227 registers):
      0.157 / 0.563 / 2.241 -> 0.142 / 0.524 / 2.162 ms at 1 / 4 / 16 tokens (eager);
    power-of-two parts, partial sums folded before the reduction (1,002 / 447, 168 registers):
      0.125 / 0.448 / 1.836 ms (eager);
    BLOCK_R 16 instead of 8 (GPU time; the activation loads serve twice the rows):
      0.123 / 0.427 / 1.70-1.72 ms = 53 / 54.5 / 39 % of 4.3 TB/s (8 rows: 0.121 / 0.447 / 1.833);
      benchmarks/bench_moe.py at K3's 896 experts (1 / 4 / 8 / 16 tokens route to 16 / 62 / 121 / 218
      slots): 0.121 / 0.424 / 0.832 / 1.665 ms = 53.9 / 59.7 / 59.4 / 53.4 %, 2.35-2.52x the bf16 peer.
  With 256 experts, 16 tokens route 256 pairs to only 164 slots, and the bytes of 164 slots are what
  must be read: 39.6 % of 4.3 TB/s on those (1.72x the peer), as each pair decodes its slot's rows.
  A slot routed by several tokens is decoded once per token (the second read of its rows can hit L2):
  decoding the rows once for two tokens per pass (both activation sets in registers: 231 registers at
  two warps, where one token's pass fits one warp) measured 2x slower at 4 and 16 tokens (1.17 and
  3.73 ms against 0.56 and 2.24): every program then paid the two-token register count.
  Two launches (one for pairs of a slot's routed tokens, decoding each row once for both, one for the
  odd token left) keep the single-token program's registers, and measured slower too (H200, one run):
  N=4, 8, 16 took 0.598, 1.157, 2.351 ms against 0.573, 1.117, 2.250 ms for one launch (pair program
  of one warp; two and four warps were slower still, 0.61-2.62 ms). With two tokens a thread holds
  twice the activations, so the pair program spreads the groups over more threads or registers, and the
  per-row reductions, scales and SiTU-GLU grow with it: 3.7 instructions per code and token at two
  warps (255 registers) against 4.6, not enough to pay for half the occupancy and the extra launches.
  History on the H200 (bench_moe.py, top-16 of 256): per-element dequantisation in a [rows, K] tile
  (nibble split, ``tl.join`` interleave, a scale multiply per element: 11.4 SASS instructions per
  code) ran at 26 % of 4.3 TB/s for one token, bound by instruction issue (Nsight Compute: 76-81 % of
  the SM's instruction throughput, 19-20 % of DRAM); the PTX decode cut that to ~4.5 per code but the
  time stayed, now bound by that layout's activation loads (one fp32 load per code per row: L1 at
  78 %); one group per thread with the activations in registers and the pipelined row loop reached
  42 % (0.156 ms; ``GEMV_TILES`` swept over rows per program, rows per step and warps: one warp of 8
  rows was best then; with the parts, one warp of 16 rows, RB 1: 32 rows or RB 2 or two warps
  measured 0-20 % slower). Nsight Compute then shows instruction issue binding again (67 % of issue slots,
  ~5.5 instructions per code: the per-row reduction, scale and SiTU-GLU beside the 3.4 of the decode
  and the FMA). At 4 and 16 tokens this path took 1.28 -> 0.56 ms and 3.44 -> 2.24 ms from the
  tensor-core passes, which are now used for prefill only.

*Skipping unrouted pairs.* A token lane is live only where ``gates[slot, token] != 0``: dead lanes
load nothing and store nothing, and a program with no live lane reads no weight at all, so
placeholder slots (docs/design.md §14) cost a few gate loads. Two pair layouts, chosen by shape:
- dense (decode: N <= BLOCK_T, or up to ``DENSE_MAX_TOKENS`` while its buffers stay under
  ``DENSE_PAIR_BYTES``): pair (slot, token) is row ``slot * N + token``; a step is one or a few token
  tiles (or, MXFP4, one walk over the slot's routed tokens), so little is to be gained from
  compaction, and no host sync is needed (docs/design.md §14: a decode step of batch 32 once took this
  layout's sibling below and synchronised in every MoE layer, 24 times per step of the small config).
- compact (prefill): each slot's routed tokens are listed in ascending order (rank = cumsum of the
  routed mask, offsets = cumsum of the counts, a scatter of token ids), and token tiles walk those
  lists, so compute scales with the routed pairs, not with slots x tokens. The buffers are sized by
  the number of routed pairs and the grid by the longest list: both are read back together (one
  host sync per call; decode batches within the dense limits never take this path).

*Dequantisation in registers.* FP8: the e4m3 byte converts to fp32 (hardware cvt on the GPU) and is
multiplied by its group scale 2^(s-127), built from the E8M0 byte as fp32 exponent bits. MXFP4 in the
tensor-core passes (several tokens): the packed byte splits into the even (low) and odd (high)
nibble, ``tl.join`` + reshape interleaves them into element order, and the E2M1 code's 3 magnitude
bits are placed in fp16's exponent/mantissa (``(c & 7) << 9``, sign at bit 15): that fp16 is the
E2M1 value times 2^-14 (0.5 lands on an fp16 subnormal, which every conversion keeps exact), so one
multiply by 2^(s-127+14) gives the weight (the one-token path's PTX builds the same fp16).
Every weight value is the reference's value exactly.

*Precision.* Accumulation is fp32. On the GPU each weight tile is cast to bf16 (exact: e4m3 has
3 mantissa bits) and the fp32 activations are split into ``hi = bf16(x)``, ``lo = bf16(x - hi)``;
two bf16 tensor-core dots then carry about 16 mantissa bits of x (relative error <= 2^-17 per
product, against 2^-24 for fp32) instead of the 8 of a single bf16 dot. The interpreter computes
fp32 dots with ``input_precision="ieee"`` (its bf16 tl.dot is wrong: docs/design.md §12).

*Bytes moved* per routed expert with I*L elements per matrix (K3: I*L = 11.0 M):
- fused MXFP4 MLP: 3 * I*L * (1/2 + 1/32) = 17.6 MB of weights, read from DRAM once per launch at
  decode (a second routed token of the slot re-reads them, mostly from L2);
- workspace path: conversion (51.6 MB, above) + MLP over FP8, 3 * I*L * (1 + 1/32) = 34.1 MB;
- bf16 weights (the plain-torch peer): 3 * I*L * 2 = 66.1 MB.
At decode (one token tile) every weight byte of a routed slot is read from DRAM once; the h and
per-pair buffers (N*(I+L)*4 bytes per slot) are small beside them. At prefill each token tile of a
slot re-reads that slot's tile rows; consecutive programs share them (token tile is the fastest grid
axis), so most repeats hit L2.

fp64 inputs (exactness tests only) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_conversion, check_fp8_mlp, check_mxfp4_mlp, expert_mlp_fp8_ref, expert_mlp_mxfp4_ref

# Calls of up to DENSE_MAX_TOKENS tokens (decode batches) use the dense pair layout, which needs no host
# sync, while its two pair buffers (slots x tokens rows of I and L fp32) fit in DENSE_PAIR_BYTES: every
# decode batch of the scaled configs, and K3's up to 16 tokens (256 slots: 109 MB). Larger calls compact.
DENSE_MAX_TOKENS = 64
DENSE_PAIR_BYTES = 256 * 2**20
CONVERT_BLOCK = {"cuda": 8192, "cpu": 2048}  # uint16 words of codes per conversion program
CONVERT_WARPS = 4  # warps per conversion program on the GPU (benchmarks/tune_moe.py sweeps both)
# Decode tiles of the matrix-vector path: FP8 (one token): rows per program, K per step, warps; MXFP4
# (every decode size): a program computes BLOCK_R rows, RB at a time, each over the whole K (see
# _mxfp4_rows).
GEMV_TILES = {"cuda": dict(BLOCK_R=8, BLOCK_K=256, num_warps=4), "cuda_mxfp4": dict(BLOCK_R=16, RB=1, num_warps=1),
              "cpu": dict(BLOCK_R=16, BLOCK_K=32, num_warps=1),
              "cpu_mxfp4": dict(BLOCK_R=64, RB=32, num_warps=1)}  # (64 rows: the tests' L and I leave tails)


# ------------------------------------------------------------------------------------------ conversion
@triton.jit
def _e2m1_to_e4m3(code):
    """int32 E2M1 codes 0..15 -> the e4m3 bytes of the same values (int32)."""
    mag = code & 7
    byte = tl.where(mag >= 2, 0x30 + 4 * mag, tl.where(mag == 1, 0x30, 0))
    return byte | ((code & 8) << 4)


@triton.jit
def _convert_kernel(packed_ptr, scales_ptr, experts_ptr, out_ptr, out_scales_ptr, nwords,
                    sp_e, ss_e, so_e, sos_e, BLOCK: tl.constexpr):
    """BLOCK uint16 words (two packed bytes, four E2M1 codes) of one slot -> BLOCK int32 words (four e4m3
    bytes), and the words' E8M0 scales (strides in words)."""
    slot = tl.program_id(1).to(tl.int64)
    expert = tl.load(experts_ptr + slot).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < nwords
    w = tl.load(packed_ptr + expert * sp_e + offs, mask=ok, other=0).to(tl.int32) & 0xFFFF  # byte 0 = low bits
    out = (_e2m1_to_e4m3(w & 0x0F) | (_e2m1_to_e4m3((w >> 4) & 0x0F) << 8)
           | (_e2m1_to_e4m3((w >> 8) & 0x0F) << 16) | (_e2m1_to_e4m3(w >> 12) << 24))
    tl.store(out_ptr + slot * so_e + offs, out, mask=ok)
    g = tl.program_id(0) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)  # 8 words share a scale
    g_ok = g < nwords // 8
    s = tl.load(scales_ptr + expert * ss_e + g, mask=g_ok)
    tl.store(out_scales_ptr + slot * sos_e + g, s, mask=g_ok)


def _require_rows_contiguous(name: str, t: torch.Tensor) -> None:
    """Each expert's [M, n] block must be contiguous (the kernels address it flat); the expert dim may stride."""
    if t.shape[-1] > 1 and t.stride(-1) != 1 or t.shape[-2] > 1 and t.stride(-2) != t.shape[-1]:
        raise ValueError(f"{name} must be contiguous within each expert (strides {t.stride()}); "
                         f"pass a view of the stored [E, 3, n] buffer")


def mxfp4_to_fp8(packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                 out_elements: torch.Tensor, out_scales: torch.Tensor) -> None:
    """In place: the experts listed in ``experts`` converted into workspace slots 0..n-1 (bit-exact).

    Args:
        packed: uint8 [E, M, P]; scales: uint8 [E, M, P/16]; experts: integer [n];
        out_elements: float8_e4m3fn [cap, M, 2P]; out_scales: uint8 [cap, M, P/16] (n <= cap).
    """
    n, M, P = check_conversion(packed, scales, experts, out_elements, out_scales)
    for name, t in (("packed", packed), ("scales", scales), ("out_elements", out_elements),
                    ("out_scales", out_scales)):
        _require_rows_contiguous(name, t)
    if n == 0 or P == 0:
        return
    # P is a multiple of 16 (checked), so a matrix is whole uint16 words of codes and int32 words of output
    src, dst = packed.view(torch.int16), out_elements.view(torch.int32)  # [E, M, P/2], [cap, M, P/2]
    block = CONVERT_BLOCK["cuda" if packed.is_cuda else "cpu"]
    grid = (triton.cdiv(M * P // 2, block), n)
    _convert_kernel[grid](src, scales, experts.contiguous(), dst, out_scales, M * P // 2,
                          src.stride(0), scales.stride(0), dst.stride(0), out_scales.stride(0),
                          BLOCK=block, num_warps=CONVERT_WARPS)


# ------------------------------------------------------------------------------------ dequantisation
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
def _scaled(v, s_ptr, rows, row_ok, KG, k0, SHIFT: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    """v [ROWS, BK] element values times their group scales (groups of 32 along K, rows x KG scales)."""
    g = k0 // 32 + tl.arange(0, BK // 32)
    s = tl.load(s_ptr + rows[:, None] * KG + g[None, :], mask=row_ok[:, None] & (g < KG)[None, :], other=127)
    return tl.reshape(tl.reshape(v, (ROWS, BK // 32, 32)) * _e8m0(s, SHIFT)[:, :, None], (ROWS, BK))


@triton.jit
def _weight_tile(w_ptr, s_ptr, rows, row_ok, K, k0, MXFP4: tl.constexpr, ROWS: tl.constexpr,
                 BK: tl.constexpr):
    """fp32 [ROWS, BK] tile (rows ``rows``, columns k0..k0+BK) of one row-major [*, K] expert matrix."""
    if MXFP4:
        c = k0 // 2 + tl.arange(0, BK // 2)
        ok = row_ok[:, None] & (c < K // 2)[None, :]
        b = tl.load(w_ptr + rows[:, None] * (K // 2) + c[None, :], mask=ok, other=0).to(tl.int32)
        codes = tl.reshape(tl.join(b & 0x0F, b >> 4), (ROWS, BK))  # low nibble = even element
        bits = ((codes & 7) << 9) | ((codes & 8) << 12)  # fp16 holding the E2M1 value * 2^-14
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return _scaled(v, s_ptr, rows, row_ok, K // 32, k0, 14, ROWS, BK)
    else:
        k = k0 + tl.arange(0, BK)
        ok = row_ok[:, None] & (k < K)[None, :]
        v = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=ok, other=0.0).to(tl.float32)
        return _scaled(v, s_ptr, rows, row_ok, K // 32, k0, 0, ROWS, BK)


@triton.jit
def _gemv_rows(w_ptr, s_ptr, rows, row_ok, K, x_ptr, ROWS: tl.constexpr, BK: tl.constexpr):
    """W[rows, :] @ x for one row-major [*, K] FP8 expert matrix and one activation row x [K] -> [ROWS] fp32:
    weight x activation products accumulated elementwise on the FMA units, reduced along K at the end."""
    acc = tl.zeros((ROWS, BK), tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        acc += _weight_tile(w_ptr, s_ptr, rows, row_ok, K, k0, False, ROWS, BK) * tl.load(
            x_ptr + k, mask=k < K, other=0.0)[None, :]
    return tl.sum(acc, axis=1)


# E2M1 -> fp16 in PTX, for one 32-bit word of eight codes (code j in bits 4j..4j+3). Each code becomes
# the high byte [sign 000 mag 0] of an fp16 whose low byte is 0, i.e. the fp16 with the code's magnitude
# bits at 9..11 and its sign at 15: the E2M1 value times 2^-14, exactly (the same fp16 as the plain path
# below). Even codes: (w << 1) & 0x0E (magnitude) | (w << 4) & 0x80 (sign) per byte; odd codes:
# (w >> 3) & 0x0E | w & 0x80. One prmt then places two of those bytes as the high bytes of an fp16 pair
# (its selector's 4s read the zero register), and a cvt per code widens it to fp32 (HADD2.F32 in SASS).
# 11 integer instructions per 8 codes, against ~40 for the nibble split, join and shift per code.
_E2M1_PTX = tl.constexpr("""
{
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
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
cvt.f32.f16 $4, h4;
cvt.f32.f16 $5, h5;
cvt.f32.f16 $6, h6;
cvt.f32.f16 $7, h7;
}
""")


@triton.jit
def _e2m1_code(w, J: tl.constexpr):
    """Code J of int32 words of eight E2M1 codes -> fp32 value * 2^-14 (the fp16 trick of _weight_tile)."""
    c = w >> (4 * J)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _words(G0, UNITS: tl.constexpr, WPU: tl.constexpr):
    """Word offsets [1, UNITS, WPU] of one part of a K row: UNITS units of WPU words from group G0."""
    return G0 * 4 + (tl.arange(0, UNITS) * WPU)[None, :, None] + tl.arange(0, WPU)[None, None, :]


@triton.jit
def _x_part(x_ptr, K, G0, UNITS: tl.constexpr, WPU: tl.constexpr):
    """One part of the activation row as its 8 planes x_j = x[j::8] (stored planar, [8, K/8], see
    _launch_mlp), [1, UNITS, WPU] each, zero past K: vector loads, once per program and token."""
    wo = _words(G0, UNITS, WPU)
    ok = wo < K // 8
    plane = K // 32 * 4  # K/8, written so that the compiler sees a multiple of 4 words (16-byte loads)
    return (tl.load(x_ptr + wo, mask=ok, other=0.0), tl.load(x_ptr + plane + wo, mask=ok, other=0.0),
            tl.load(x_ptr + 2 * plane + wo, mask=ok, other=0.0), tl.load(x_ptr + 3 * plane + wo, mask=ok, other=0.0),
            tl.load(x_ptr + 4 * plane + wo, mask=ok, other=0.0), tl.load(x_ptr + 5 * plane + wo, mask=ok, other=0.0),
            tl.load(x_ptr + 6 * plane + wo, mask=ok, other=0.0), tl.load(x_ptr + 7 * plane + wo, mask=ok, other=0.0))


@triton.jit
def _x_parts(x_ptr, K, GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr):
    """The activation planes of the three parts of K (see _mxfp4_rows); an absent part repeats part A."""
    xa = _x_part(x_ptr, K, 0, GA, 4)
    xb = xa
    xc = xa
    if GB > 0:
        xb = _x_part(x_ptr, K, GA, GB, 4)
    if HC > 0:
        xc = _x_part(x_ptr, K, GA + GB, HC, 2)
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
        c = tl.inline_asm_elementwise(_E2M1_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8,
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
    return tl.sum(p, axis=2) * _e8m0(s, 14)


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
    a single padded [128 groups] tile gave every thread 16 (12.5 % of them masked; 25 % for K = 3072)."""
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
    the loop its ~100 instructions ran per step for one row's value), and each step's group scales are
    loaded a step ahead (uint8 loads are not prefetched by the compiler)."""
    x = _x_parts(z_ptr + t * L, L, GA, GB, HC)
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
    h = _situ_glu(tl.reshape(g_rows, [BLOCK_R]), tl.reshape(u_rows, [BLOCK_R]), beta_gate, beta_up) * gate
    tl.store(h_ptr + pair * I + (rows % 8) * (I // 8) + rows // 8, h, mask=rows < I)  # 8 planes h[j::8]


@triton.jit
def _down_token(h_ptr, w2, s2, part_ptr, pair, L, I, BLOCK_R: tl.constexpr, RB: tl.constexpr,
                GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr, PTX: tl.constexpr):
    """part[pair, rows] of the program's BLOCK_R latent rows for one routed (slot, token) pair (group
    scales loaded a step ahead, as in _up_token)."""
    x = _x_parts(h_ptr + pair * I, I, GA, GB, HC)
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
def _dot(w, x_t, acc, SPLIT: tl.constexpr):
    """acc + w @ x_t for fp32 w [R, K] (bf16-exact weights) and fp32 x_t [K, T], accumulated in fp32."""
    if SPLIT:  # GPU: two bf16 tensor-core dots carry ~16 mantissa bits of x
        wb = w.to(tl.bfloat16)
        hi = x_t.to(tl.bfloat16)
        lo = (x_t - hi.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(wb, hi, acc)
        acc = tl.dot(wb, lo, acc)
    else:  # interpreter: plain fp32
        acc = tl.dot(w, x_t, acc, input_precision="ieee")
    return acc


@triton.jit
def _tanh(x):
    """tanh from exp (no libdevice in the interpreter): odd Taylor series below |x| = 0.1, where
    (1 - e^-2|x|) / (1 + e^-2|x|) would cancel, that quotient above it (relative error ~1e-7)."""
    a = tl.abs(x)
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    e = tl.exp(-2.0 * a)
    t = tl.where(a < 0.1, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _situ_glu(g, u, beta_gate, beta_up):
    """beta_gate * tanh(g / beta_gate) * sigmoid(g) * beta_up * tanh(u / beta_up) (minidsa.ffn.situ_glu)."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    return (beta_gate * _tanh(g / beta_gate) * sig) * (beta_up * _tanh(u / beta_up))


# ---------------------------------------------------------------------------------------- MLP passes
@triton.jit
def _pairs(slot, tile, gates_ptr, count_ptr, offset_ptr, token_ptr, N, DENSE: tl.constexpr,
           BLOCK_T: tl.constexpr):
    """The token lanes of a program: (pair row int64, token, gate fp32, live) [BLOCK_T] each."""
    j = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    if DENSE:  # pair (slot, token) is row slot * N + token
        inside = j < N
        token = j
        pair = slot.to(tl.int64) * N + j
    else:  # the slot's routed tokens, listed from its offset
        inside = j < tl.load(count_ptr + slot)
        pair = tl.load(offset_ptr + slot).to(tl.int64) + j
        token = tl.load(token_ptr + pair, mask=inside, other=0)
    gate = tl.load(gates_ptr + slot.to(tl.int64) * N + token, mask=inside, other=0.0).to(tl.float32)
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
def _up_decode(z_ptr, w1, s1, sw_m, ss_m, gates_ptr, h_ptr, slot, N, L, I, beta_gate, beta_up,
               BLOCK_R: tl.constexpr, RB: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr,
               PTX: tl.constexpr):
    """The up pass at decode (MXFP4): each of the slot's routed tokens on its own (a second token's read
    of the rows can hit L2)."""
    for t in range(N):
        gate = tl.load(gates_ptr + slot * N + t).to(tl.float32)
        if gate != 0.0:
            _up_token(z_ptr, w1, s1, sw_m, ss_m, h_ptr, slot.to(tl.int64) * N + t, t, gate, L, I, beta_gate, beta_up,
                      BLOCK_R, RB, GA, GB, HC, PTX)


@triton.jit
def _down_decode(h_ptr, w2, s2, gates_ptr, part_ptr, slot, N, L, I, BLOCK_R: tl.constexpr, RB: tl.constexpr,
                 GA: tl.constexpr, GB: tl.constexpr, HC: tl.constexpr, PTX: tl.constexpr):
    """The down pass at decode (MXFP4), over the slot's routed tokens like _up_decode."""
    for t in range(N):
        if tl.load(gates_ptr + slot * N + t).to(tl.float32) != 0.0:
            _down_token(h_ptr, w2, s2, part_ptr, slot.to(tl.int64) * N + t, L, I, BLOCK_R, RB, GA, GB, HC, PTX)


# N (tokens) is left unspecialised in the three passes: a new token count (prompt length, batch) compiles
# no new variant; it only masks token rows and scales offsets.
@triton.jit(do_not_specialize=["N"])
def _up_kernel(z_ptr, w_ptr, s_ptr, experts_ptr, gates_ptr, count_ptr, offset_ptr, token_ptr, h_ptr,
               N, L, I, sw_e, sw_m, ss_e, ss_m, beta_gate, beta_up,
               MXFP4: tl.constexpr, HAS_MAP: tl.constexpr, DENSE: tl.constexpr, SPLIT: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GEMV: tl.constexpr,
               PTX: tl.constexpr, RB: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
               HC: tl.constexpr):
    """h[pair, rows] = gate * SiTU-GLU(W1 z, W3 z) for one slot, BLOCK_R rows of I and one token tile."""
    slot = tl.program_id(2)
    if GEMV and MXFP4:  # decode, MXFP4: matrix-vector products over the slot's routed tokens
        w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
        _up_decode(z_ptr, w1, s1, sw_m, ss_m, gates_ptr, h_ptr, slot, N, L, I, beta_gate, beta_up, BLOCK_R, RB, GA, GB,
                   HC, PTX)
        return
    if GEMV:  # one token, FP8: the slot's pair is row ``slot``
        gate = tl.load(gates_ptr + slot).to(tl.float32)
        if gate != 0.0:
            rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
            row_ok = rows < I
            w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
            g = _gemv_rows(w1, s1, rows, row_ok, L, z_ptr, BLOCK_R, BLOCK_K)
            u = _gemv_rows(w1 + sw_m, s1 + ss_m, rows, row_ok, L, z_ptr, BLOCK_R, BLOCK_K)
            h = _situ_glu(g, u, beta_gate, beta_up) * gate
            tl.store(h_ptr + slot.to(tl.int64) * I + rows, h, mask=row_ok)
        return
    pair, token, gate, live = _pairs(slot, tl.program_id(0), gates_ptr, count_ptr, offset_ptr, token_ptr, N,
                                     DENSE, BLOCK_T)
    if tl.max(live.to(tl.int32), axis=0) > 0:  # no routed token here: read no weight at all
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < I
        w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
        acc_g = tl.zeros((BLOCK_R, BLOCK_T), tl.float32)
        acc_u = tl.zeros((BLOCK_R, BLOCK_T), tl.float32)
        for k0 in range(0, L, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            z_t = tl.load(z_ptr + token[None, :] * L + k[:, None], mask=live[None, :] & (k < L)[:, None], other=0.0)
            acc_g = _dot(_weight_tile(w1, s1, rows, row_ok, L, k0, MXFP4, BLOCK_R, BLOCK_K), z_t, acc_g, SPLIT)
            acc_u = _dot(_weight_tile(w1 + sw_m, s1 + ss_m, rows, row_ok, L, k0, MXFP4, BLOCK_R, BLOCK_K), z_t,
                         acc_u, SPLIT)
        h = _situ_glu(acc_g, acc_u, beta_gate, beta_up) * gate[None, :]
        tl.store(h_ptr + pair[None, :] * I + rows[:, None], h, mask=row_ok[:, None] & live[None, :])


@triton.jit(do_not_specialize=["N"])
def _down_kernel(h_ptr, w_ptr, s_ptr, experts_ptr, gates_ptr, count_ptr, offset_ptr, token_ptr, part_ptr,
                 N, L, I, sw_e, sw_m, ss_e, ss_m,
                 MXFP4: tl.constexpr, HAS_MAP: tl.constexpr, DENSE: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GEMV: tl.constexpr,
               PTX: tl.constexpr, RB: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
               HC: tl.constexpr):
    """part[pair, rows] = W2[rows] @ h[pair] for one slot, BLOCK_R latent rows and one token tile."""
    slot = tl.program_id(2)
    if GEMV and MXFP4:
        w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
        _down_decode(h_ptr, w1 + 2 * sw_m, s1 + 2 * ss_m, gates_ptr, part_ptr, slot, N, L, I, BLOCK_R, RB, GA, GB, HC,
                     PTX)
        return
    if GEMV:
        if tl.load(gates_ptr + slot).to(tl.float32) != 0.0:
            rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
            row_ok = rows < L
            w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
            part = _gemv_rows(w1 + 2 * sw_m, s1 + 2 * ss_m, rows, row_ok, I, h_ptr + slot.to(tl.int64) * I, BLOCK_R,
                              BLOCK_K)
            tl.store(part_ptr + slot.to(tl.int64) * L + rows, part, mask=row_ok)
        return
    pair, token, gate, live = _pairs(slot, tl.program_id(0), gates_ptr, count_ptr, offset_ptr, token_ptr, N,
                                     DENSE, BLOCK_T)
    if tl.max(live.to(tl.int32), axis=0) > 0:
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < L
        w1, s1 = _expert_ptrs(w_ptr, s_ptr, experts_ptr, slot, sw_e, ss_e, HAS_MAP)
        acc = tl.zeros((BLOCK_R, BLOCK_T), tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            h_t = tl.load(h_ptr + pair[None, :] * I + k[:, None], mask=live[None, :] & (k < I)[:, None], other=0.0)
            w2 = _weight_tile(w1 + 2 * sw_m, s1 + 2 * ss_m, rows, row_ok, I, k0, MXFP4, BLOCK_R, BLOCK_K)
            acc = _dot(w2, h_t, acc, SPLIT)
        tl.store(part_ptr + pair[None, :] * L + rows[:, None], acc, mask=row_ok[:, None] & live[None, :])


@triton.jit(do_not_specialize=["m", "N"])
def _combine_kernel(part_ptr, gates_ptr, rank_ptr, offset_ptr, out_ptr, m, N, L, DENSE: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):
    """y[token, cols] = sum over slots (fixed order) of the token's per-pair rows; unrouted slots skipped."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    col_ok = cols < L
    acc = tl.zeros((BLOCK_L,), tl.float32)
    for s0 in range(0, m, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        routed = (s < m) & (tl.load(gates_ptr + s.to(tl.int64) * N + token, mask=s < m, other=0.0) != 0.0)
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
def _config(on_gpu: bool, dense: bool) -> dict:
    """Tile sizes: decode (dense) favours many small weight-streaming programs; prefill (compact) a
    tensor-core-sized tile of 128 weight rows x 64 tokens. The interpreter gets the smallest legal
    tiles (it pays per program and per element). BLOCK_K is a multiple of the 32-element scale group."""
    if not on_gpu:
        return dict(BLOCK_T=16, BLOCK_R=32, BLOCK_K=32, num_warps=4, BLOCK_S=16, BLOCK_L=32)
    if dense:
        return dict(BLOCK_T=16, BLOCK_R=64, BLOCK_K=128, num_warps=4, num_stages=3, BLOCK_S=16, BLOCK_L=256)
    return dict(BLOCK_T=64, BLOCK_R=128, BLOCK_K=64, num_warps=8, num_stages=3, BLOCK_S=16, BLOCK_L=256)


def _compact(gates: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-slot lists of routed tokens: (rank int32 [m, N] inclusive, count int32 [m], offset int32 [m],
    token int32 [pairs + 1], pairs, the longest list). Reads those two numbers back to the host (one
    sync): the buffers are sized by the pairs and the grid by the longest list, not by N."""
    m, N = gates.shape
    routed = gates != 0
    rank = torch.cumsum(routed, 1, dtype=torch.int32)
    count = rank[:, -1].contiguous()
    offset = torch.cumsum(count, 0, dtype=torch.int32) - count
    pairs, longest = torch.stack([count.sum(), count.max()]).tolist()
    dest = torch.where(routed, offset[:, None] + rank - 1, pairs).view(-1).long()  # unrouted -> a spare row
    tokens = torch.arange(N, dtype=torch.int32, device=gates.device).expand(m, N).reshape(-1)
    token = torch.empty(pairs + 1, dtype=torch.int32, device=gates.device).scatter_(0, dest, tokens)
    return rank, count, offset, token, pairs, longest


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


def _gemv_meta(meta: dict, on_gpu: bool, L: int, I: int) -> tuple[dict, dict, dict]:
    """The launch constexprs with the matrix-vector tiles, and the up and down passes' K parts (MXFP4
    decode only; GA = 1 elsewhere, so each model shape compiles one variant)."""
    gemv, mxfp4 = meta["GEMV"], meta["MXFP4"]
    if gemv:  # matrix-vector products on the FMA units
        meta = dict(meta, **GEMV_TILES[("cuda" if on_gpu else "cpu") + ("_mxfp4" if mxfp4 else "")])
        meta.setdefault("BLOCK_K", 32)
    meta.setdefault("RB", 1)
    if not (gemv and mxfp4):
        none = dict(GA=1, GB=0, HC=0)
        return meta, none, none
    return meta, _k_parts(L), _k_parts(I)


def _launch_mlp(z, w, s, experts, gates, beta_gate, beta_up, L, I, dense: bool | None = None) -> torch.Tensor:
    """The three passes; ``experts`` None means slot j is storage row j (the FP8 workspace)."""
    N, m = z.shape[0], gates.shape[0]
    out = torch.zeros(N, L, dtype=torch.float32, device=z.device)
    if N == 0 or m == 0:
        return out
    on_gpu = z.is_cuda
    if dense is None:
        fits = N <= DENSE_MAX_TOKENS and m * N * (I + L) * 4 <= DENSE_PAIR_BYTES
        dense = N <= _config(on_gpu, True)["BLOCK_T"] or fits
    cfg = _config(on_gpu, dense)
    z, gates = z.float().contiguous(), gates.float().contiguous()
    if dense:
        rank = count = offset = token = gates  # unused pointers
        pairs, longest = m * N, N
    else:
        rank, count, offset, token, pairs, longest = _compact(gates)
        if pairs == 0:  # no token routed anywhere
            return out
    h = torch.empty(pairs, I, dtype=torch.float32, device=z.device)
    part = torch.empty(pairs, L, dtype=torch.float32, device=z.device)
    shared = (w, s, gates if experts is None else experts.contiguous(), gates, count, offset, token)
    strides = (N, L, I, w.stride(0), w.stride(1), s.stride(0), s.stride(1))
    meta = dict(MXFP4=w.dtype == torch.uint8, HAS_MAP=experts is not None, DENSE=dense, SPLIT=on_gpu,
                BLOCK_T=cfg["BLOCK_T"], BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"])
    if on_gpu:
        meta["num_stages"] = cfg["num_stages"]
    # matrix-vector products: the FP8 MLP for one token, the MXFP4 one per routed pair at every decode size
    meta["GEMV"] = dense and (N == 1 or w.dtype == torch.uint8)
    meta["PTX"] = on_gpu and triton.runtime.driver.active.get_current_target().backend == "cuda"
    if meta["GEMV"] and meta["MXFP4"]:  # activations as 8 planes z[n, j::8] (see _x_part)
        z = z.view(N, L // 8, 8).transpose(1, 2).contiguous()
    tiles = max(1, triton.cdiv(longest, cfg["BLOCK_T"]))  # token tiles per slot
    meta, parts_up, parts_down = _gemv_meta(meta, on_gpu, L, I)
    _up_kernel[(tiles, triton.cdiv(I, meta["BLOCK_R"]), m)](z, *shared, h, *strides, float(beta_gate),
                                                            float(beta_up), **meta, **parts_up)
    _down_kernel[(tiles, triton.cdiv(L, meta["BLOCK_R"]), m)](h, *shared, part, *strides, **meta, **parts_down)
    _combine_kernel[(N, triton.cdiv(L, cfg["BLOCK_L"]))](part, gates, rank, offset, out, m, N, L, DENSE=dense,
                                                         BLOCK_S=cfg["BLOCK_S"], BLOCK_L=cfg["BLOCK_L"])
    return out


def expert_mlp_fp8(z: torch.Tensor, elements: torch.Tensor, scales: torch.Tensor, gates: torch.Tensor,
                   beta_gate: float, beta_up: float) -> torch.Tensor:
    """Routed-expert MLPs over the FP8 workspace slots: z [N, L], elements float8_e4m3fn [cap, 3, I*L],
    scales uint8 [cap, 3, I*L/32], gates [m, N] (0 = not routed) -> y_lat [N, L] fp32."""
    N, L, I, m = check_fp8_mlp(z, elements, scales, gates)
    if torch.float64 in (z.dtype, gates.dtype):
        return expert_mlp_fp8_ref(z, elements, scales, gates, beta_gate, beta_up)
    _require_rows_contiguous("elements", elements)
    _require_rows_contiguous("scales", scales)
    return _launch_mlp(z, elements, scales, None, gates, beta_gate, beta_up, L, I)


def expert_mlp_mxfp4(z: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                     gates: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    """Routed-expert MLPs straight from MXFP4 storage: z [N, L], packed uint8 [E, 3, I*L/2], scales uint8
    [E, 3, I*L/32], experts integer [m] (slot j = expert experts[j]), gates [m, N] -> y_lat [N, L] fp32."""
    N, L, I, m = check_mxfp4_mlp(z, packed, scales, experts, gates)
    if torch.float64 in (z.dtype, gates.dtype):
        return expert_mlp_mxfp4_ref(z, packed, scales, experts, gates, beta_gate, beta_up)
    _require_rows_contiguous("packed", packed)
    _require_rows_contiguous("scales", scales)
    return _launch_mlp(z, packed, scales, experts, gates, beta_gate, beta_up, L, I)
