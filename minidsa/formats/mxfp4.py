"""MXFP4 (OCP Microscaling, E2M1 elements + E8M0 scales) and its exact conversion to FP8 (docs/design.md §7).

Layout (gpt-oss / compressed-tensors ``mxfp4-pack-quantized``) of a weight W [rows, K]:
    packed uint8 [rows, K/2]   two E2M1 codes per byte, the LOW nibble holds the even (lower-index) element
    scales uint8 [rows, K/32]  one E8M0 exponent per 32 consecutive elements along K: 2^(s - 127); 0xFF = NaN
E2M1 code: bit 3 = sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (no Inf, no NaN).

Every E2M1 value is exact in float8_e4m3fn, so converting the elements and keeping the E8M0 scales
beside them loses nothing; that is what the FP8 expert workspace holds.
"""

from __future__ import annotations

import functools

import torch

GROUP = 32  # elements sharing one E8M0 scale
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_EMAX = 2  # exponent of the largest E2M1 magnitude (6 = 1.5 * 2^2)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# The largest E8M0 code a checkpoint may hold: scale 2^16, so a group's values reach 6 * 2^16 ~ 4e5, far
# beyond any trained weight (quantize gives 2^(floor(log2 amax) - 2)). Codes up to 0xFE are legal, but
# near the top the elements alone reach 6 * 2^127, past fp32's 3.4e38: the forward would overflow.
E8M0_MAX_PLAUSIBLE = E8M0_BIAS + 16
# Midpoints between neighbouring magnitudes. At an exact midpoint the even code wins
# (round-half-to-even on the mantissa bit): below an even code '>' is needed to move up, below an odd
# code '>=' is enough.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@functools.lru_cache(maxsize=None)
def e2m1_table(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The 16 code values: [0, 0.5, ..., 6, -0, -0.5, ..., -6] (cached per dtype and device; do not modify)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    with torch.inference_mode(False):
        return torch.cat([mags, -mags]).to(dtype)


def e8m0_to_float(scales: torch.Tensor, dtype: torch.dtype = torch.float32, name: str = "scales",
                  check: bool = True) -> torch.Tensor:
    """uint8 E8M0 exponents -> 2^(s - 127). 0xFF (NaN) is rejected with an error naming the tensor
    (``check=False`` skips that scan for scales already validated at load, e.g. in the workspace)."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 E8M0 exponents, got {scales.dtype}")
    if check and bool((scales == E8M0_NAN).any()):
        raise ValueError(f"{name} holds the E8M0 NaN code 0xFF; the checkpoint is corrupt or was written with NaN "
                         f"weights (re-export it)")
    # fp64 holds 2^-127 .. 2^127 exactly; the cast to fp32 keeps them (2^-127 is an fp32 subnormal).
    # 0xFF would give 2^128 (inf in fp32); the format defines it as NaN.
    values = torch.exp2(scales.to(torch.float64) - E8M0_BIAS)
    return values.masked_fill_(scales == E8M0_NAN, float("nan")).to(dtype)


def check_scales(scales: torch.Tensor, name: str) -> None:
    """Scales read from a checkpoint: raise ValueError naming the tensor for the NaN code 0xFF or a legal
    but absurd code above ``E8M0_MAX_PLAUSIBLE`` (found at load, not as an overflow in some later layer)."""
    if bool((scales == E8M0_NAN).any()):
        raise ValueError(f"tensor {name} holds the E8M0 NaN code 0xFF; the checkpoint is corrupt or was written "
                         f"with NaN weights (re-export it)")
    top = int(scales.max()) if scales.numel() else 0
    if top > E8M0_MAX_PLAUSIBLE:
        raise ValueError(f"tensor {name} holds the E8M0 scale code {top:#04x} = 2^{top - E8M0_BIAS}, above the "
                         f"2^{E8M0_MAX_PLAUSIBLE - E8M0_BIAS} any trained weight needs (its values reach 6 * "
                         f"2^{top - E8M0_BIAS}; near 2^127 they overflow the forward); the checkpoint is corrupt "
                         f"(re-export it)")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (float) -> (packed uint8 [..., K/2], scales uint8 [..., K/32]).

    Per group of 32: shared exponent = floor(log2(amax)) - 2 (OCP), clamped to the E8M0 range; elements
    w / 2^e rounded to the nearest E2M1 value (ties to even), saturating at +-6. Deterministic.
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"w must be a floating-point tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    K = w.shape[-1]
    if K % GROUP:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {GROUP}, got K = {K}; pad the weight")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w holds NaN or Inf; MXFP4 cannot represent them")
    # fp32 holds every value of a bf16/fp16/fp32 weight and every quotient below by a power of two that can
    # reach a midpoint (a quotient small enough to round is far below 0.25 and gets code 0 either way), so
    # only fp64 weights need fp64 arithmetic. frexp gives floor(log2(amax)) exactly, where log2 may round up
    # just below a power of two. The sign comes from w itself, which an underflowing quotient would lose.
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    x = w.detach().to(work).reshape(*w.shape[:-1], K // GROUP, GROUP)
    amax = x.abs().amax(dim=-1, keepdim=True)
    exp = torch.frexp(amax).exponent.to(work) - 1 - E2M1_EMAX  # frexp: amax = m * 2^e, m in [0.5, 1)
    exp = torch.where(amax > 0, exp, -E8M0_BIAS)  # all-zero groups get the smallest scale, code 0
    exp = exp.clamp(-E8M0_BIAS, 254 - E8M0_BIAS)
    mag = x.abs() / torch.exp2(exp)
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for i, m in enumerate(_MIDPOINTS):
        code += (mag > m if i % 2 == 0 else mag >= m).to(torch.uint8)
    code |= (x < 0).to(torch.uint8) << 3
    code = code.reshape(*w.shape[:-1], K)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exp + E8M0_BIAS).to(torch.uint8).squeeze(-1)
    return packed.contiguous(), scales.contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> codes uint8 [..., K] (low nibble first)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _check_pair(packed: torch.Tensor, scales: torch.Tensor) -> None:
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * GROUP:
        raise ValueError(f"packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not match: "
                         f"scales must be [..., K/32] for packed [..., K/2]")


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed [..., K/2], scales [..., K/32]) -> w [..., K] in ``dtype`` (exact in fp32)."""
    _check_pair(packed, scales)
    values = e2m1_table(torch.float32, packed.device)[unpack_codes(packed).long()]
    scale = e8m0_to_float(scales).repeat_interleave(GROUP, dim=-1)
    return (values * scale).to(dtype)


@functools.lru_cache(maxsize=None)
def _byte_to_fp8_pair(device=None) -> torch.Tensor:
    """int16 [256]: the two e4m3 bytes of every packed byte's E2M1 codes, low nibble first in memory
    (built by viewing the byte pair as int16, so it is right on any byte order)."""
    codes = torch.arange(256)
    pair = torch.stack([codes & 0x0F, codes >> 4], dim=-1)
    with torch.inference_mode(False):
        return e2m1_table(torch.float8_e4m3fn)[pair].view(torch.uint8).contiguous().view(torch.int16)[:, 0].to(device)


@functools.lru_cache(maxsize=None)
def byte_pair_to_fp8_quad(device=None) -> torch.Tensor:
    """int32 [65536]: for every two packed bytes (read as uint16), their four e4m3 bytes in memory order.
    One gather then writes four elements: on a CPU, where a gather costs the same at any width up to
    16 bytes, that halves the conversion's time."""
    with torch.inference_mode(False):
        byte_pairs = torch.arange(65536, dtype=torch.int32).to(torch.uint16).view(torch.uint8).view(-1, 2)
        return _byte_to_fp8_pair()[byte_pairs.long()].contiguous().view(torch.int32).view(-1).to(device)


@functools.lru_cache(maxsize=None)
def fp8_values(device=None) -> torch.Tensor:
    """fp32 [256]: the value of every e4m3 bit pattern (a lookup is faster than a cast on the CPU)."""
    with torch.inference_mode(False):
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)


@functools.lru_cache(maxsize=None)
def _e8m0_values(device=None) -> torch.Tensor:
    """fp32 [256]: 2^(s - 127) for every E8M0 code, NaN for 0xFF (which loading rejects)."""
    with torch.inference_mode(False):
        values = torch.exp2(torch.arange(256, dtype=torch.float64) - E8M0_BIAS)
        values[E8M0_NAN] = float("nan")
        return values.float().to(device)


def table_lookup(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """table [256] indexed by uint8 ``codes`` [...] -> [...] (index_select on int32: the fastest gather on CPU)."""
    return table.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def to_fp8(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact conversion for compute: (packed, scales) -> (elements float8_e4m3fn [..., K], the same scales).

    E2M1 magnitudes 0..6 are all e4m3 values, so nothing rounds; ``fp8_dequantize`` recovers ``dequantize``.
    One table lookup per packed byte gives both of its elements. (The model's online conversion into the
    shared workspace is the op ``ops.mxfp4_to_fp8``; this converts whole tensors, e.g. offline mode.)
    """
    _check_pair(packed, scales)
    pairs = table_lookup(_byte_to_fp8_pair(packed.device), packed)  # int16 [..., K/2]: both bytes at once
    return pairs.view(torch.float8_e4m3fn).view(packed.shape[:-1] + (packed.shape[-1] * 2,)), scales


def fp8_dequantize(elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 elements [..., K] with (validated) E8M0 group scales [..., K/32] -> [..., K] in ``dtype`` (exact)."""
    values = table_lookup(fp8_values(elements.device), elements.view(torch.uint8))
    scale = table_lookup(_e8m0_values(scales.device), scales)
    values.view(*values.shape[:-1], -1, GROUP).mul_(scale.unsqueeze(-1))  # in place: one buffer, not two
    return values.to(dtype)


def check_fold(scales: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Can the E8M0 scales along ``dim`` fold into one power-of-two scale with FP8 elements staying exact?

    Folding rescales each group's elements by 2^(s_g - s_ref) with s_ref = max(s) - 6 (so 6 * 2^6 = 384
    <= 448 at the top); the bottom group then needs 0.5 * 2^(min - s_ref) >= 2^-9, i.e. max - min <= 14.
    Returns a bool tensor (True where folding is exact). Never assume it: a checkpoint can violate it.
    """
    s = scales.to(torch.int32)
    return (s.amax(dim=dim) - s.amin(dim=dim)) <= 14
