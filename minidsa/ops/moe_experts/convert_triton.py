"""Triton kernel of ``mxfp4_to_fp8`` (docs/design.md §7, §12): routed experts' MXFP4 codes converted into
slots of the shared FP8 workspace. Same signature as ``mxfp4_to_fp8_ref`` (``reference.py``) and the
same bytes, bit for bit.

Grid ``(chunk of BLOCK words, slot)``; slot j reads expert ``experts[j]``. An expert's w1, w3, w2 codes
are one contiguous block, read as uint16 words (two packed bytes, four codes) and written as int32 words
(four e4m3 bytes, in element order: little-endian, as on every GPU and x86 CPU): words rather than bytes
halve the load and store instructions for the same bytes. Each code becomes its e4m3 byte by integer
arithmetic (magnitude code 0 -> 0x00, 1 (0.5) -> 0x30, c >= 2 -> 0x30 + 4c; the sign bit moves from bit 3
to bit 7). The word's E8M0 scales (one per 8 words) are copied alongside. Bytes moved per expert, with
I*L elements per matrix: read 3*I*L/2 + 3*I*L/32, write 3*I*L + 3*I*L/32 (51.6 MB at K3's L = 3584,
I = 3072).

Bound by bytes moved: ~71 % of the H200's 4.3 TB/s at K3 shapes (benchmarks/bench_moe.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_conversion

CONVERT_BLOCK = {"cuda": 8192, "cpu": 2048}  # uint16 words of codes per conversion program
CONVERT_WARPS = 4  # warps per conversion program on the GPU (benchmarks/diagnostics/tune_moe.py sweeps both)


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


def require_rows_contiguous(name: str, t: torch.Tensor) -> None:
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
        require_rows_contiguous(name, t)
    if n == 0 or P == 0:
        return
    # P is a multiple of 16 (checked), so a matrix is whole uint16 words of codes and int32 words of output
    src, dst = packed.view(torch.int16), out_elements.view(torch.int32)  # [E, M, P/2], [cap, M, P/2]
    block = CONVERT_BLOCK["cuda" if packed.is_cuda else "cpu"]
    grid = (triton.cdiv(M * P // 2, block), n)
    _convert_kernel[grid](src, scales, experts.contiguous(), dst, out_scales, M * P // 2,
                          src.stride(0), scales.stride(0), dst.stride(0), out_scales.stride(0),
                          BLOCK=block, num_warps=CONVERT_WARPS)
