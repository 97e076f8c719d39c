"""Deployment numerics of the DSA indexer: FP8 with power-of-two scales, and the Hadamard rotation.

The real indexer keeps its key cache in float8_e4m3fn with one scale per token. A power-of-two
scale (an exponent, as in UE8M0) makes scaling exact; the Walsh-Hadamard rotation spreads outlier
channels over all channels before quantising. The rotation is orthonormal, so applying it to BOTH
q_I and k_I leaves every dot product unchanged; applying it to one side only breaks retrieval
(docs/design.md §10, trap 1), which is why ``hadamard`` here is always applied by the caller to both.
"""

from __future__ import annotations

import math

import torch

FP8_E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-4  # DeepSeek's activation quantiser clamps amax here so all-zero vectors get a finite scale


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform (Sylvester order) over the last dim, which must be 2^n.

    x [..., D] -> [..., D] in fp32; equals x @ H_D / sqrt(D), H_D the Sylvester Hadamard matrix.
    """
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two last dim, got {d}")
    y = x.float()
    shape = y.shape
    h = 1
    while h < d:
        y = y.reshape(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape) / math.sqrt(d)


def quantize_fp8_pow2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector FP8 quantisation with a power-of-two scale.

    x [..., D] -> (values float8_e4m3fn [..., D], scale fp32 [..., 1]) with
    scale = 2^ceil(log2(amax / 448)), so x / scale fits in e4m3 and x ~= values * scale.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(_AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))
    values = (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return values, scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values [..., D] e4m3 and scale [..., 1] -> fp32 [..., D]."""
    return values.float() * scale.float()
