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


def hadamard_matrix(d: int) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix H_d / sqrt(d): fp32 [d, d], symmetric and orthonormal;
    d must be 2^n. H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two last dim, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(d)


def hadamard(x: torch.Tensor, matrix: torch.Tensor | None = None) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform (Sylvester order) over the last dim, which must be 2^n.

    x [..., D] -> x @ H_D / sqrt(D) in fp32, as one product (a butterfly would take log2(D) rounds of
    launches on a GPU). ``matrix``: ``hadamard_matrix(D)`` already on x's device (a model keeps it as a
    buffer, so that no forward, and no captured graph, builds or copies it).
    """
    if matrix is None:
        matrix = hadamard_matrix(x.shape[-1]).to(x.device)
    elif matrix.shape != (x.shape[-1], x.shape[-1]):
        raise ValueError(f"matrix has shape {tuple(matrix.shape)}; a rotation of x's last dim needs "
                         f"({x.shape[-1]}, {x.shape[-1]})")
    return x.float() @ matrix.float()


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
