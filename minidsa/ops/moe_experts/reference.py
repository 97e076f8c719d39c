"""Reference ops of the routed latent experts: MXFP4 -> FP8 conversion into the shared workspace, and
the routed-expert MLPs over FP8 workspace slots or straight from MXFP4 (docs/design.md §6, §7, §12).

Storage (one contiguous block per expert, ``RoutedExperts.packed`` / ``scales``):

    packed   uint8 [E, 3, I*L/2]   E2M1 codes of w1, w3 ([I, L] each) and w2 ([L, I]), row-major;
                                   the LOW nibble holds the even (lower-index) element
    scales   uint8 [E, 3, I*L/32]  one E8M0 exponent 2^(s - 127) per 32 consecutive elements of a row
    elements float8_e4m3fn [cap, 3, I*L]   the FP8 workspace (``ExpertWorkspace``), scales beside it

Every E2M1 value is exact in e4m3 and every (value * 2^(s-127)) product is exact in fp32, so the three
ops see identical weight values. The MLP, dense over the m slots (docs/design.md §14):

    h_m    = SiTU-GLU(z W1_m^T, z W3_m^T)           [m, N, I]
    y_lat  = sum_m (routing[m, :, None] * h_m) W2_m^T  [N, L]

The fast CPU forms (lookup tables, routed rows) are ``cpu.py``; the argument checks ``checks.py``.
"""

from __future__ import annotations

import torch

from ...formats.mxfp4 import GROUP, e2m1_table, e8m0_to_float
from .._checks import acc_dtype, cast
from .._dispatch import op
from .._library import result_like
from ..activation.reference import situ_glu_values
from .checks import check_conversion, check_fp8_mlp, check_mxfp4_mlp


def e2m1_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., P] packed codes -> their values [..., 2P]: the low nibble is the even element."""
    nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).long()  # [..., P, 2]
    return e2m1_table(dtype, codes.device)[nibbles].flatten(-2)


def scaled(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values [..., K] times 2^(s - 127) of their group of 32 (scales uint8 [..., K/32]), exact."""
    group_scale = e8m0_to_float(scales, values.dtype, check=False).unsqueeze(-1)
    return (values.unflatten(-1, (-1, GROUP)) * group_scale).flatten(-2)


def expert_mlp(z: torch.Tensor, w: torch.Tensor, routing: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    """z [N, L], weights w [m, 3, I*L] (w1, w3 [I, L]; w2 [L, I]), routing [m, N], one float dtype -> y_lat [N, L]."""
    L = z.shape[1]
    I = w.shape[-1] // L
    w1, w3, w2 = w[:, 0].unflatten(-1, (I, L)), w[:, 1].unflatten(-1, (I, L)), w[:, 2].unflatten(-1, (L, I))
    h = situ_glu_values(z @ w1.mT, z @ w3.mT, beta_gate, beta_up)  # [m, N, I]
    return ((h * routing.unsqueeze(-1)) @ w2.mT).sum(0)


@op(kernel="convert_triton", cpu="cpu", mutates=("out_elements", "out_scales"),
    fake=lambda packed, scales, experts, out_elements, out_scales: None)
def mxfp4_to_fp8(packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                     out_elements: torch.Tensor, out_scales: torch.Tensor) -> None:
    """In place: the experts listed in ``experts`` converted into workspace slots 0..n-1 (bit-exact).

    Args:
        packed: uint8 [E, M, P] E2M1 codes, two per byte, low nibble = even element (M = 3 in LatentMoE).
        scales: uint8 [E, M, P/16] E8M0 group scales (copied unchanged).
        experts: integer [n] expert ids; slot j receives expert experts[j].
        out_elements: float8_e4m3fn [cap, M, 2P], n <= cap; slots 0..n-1 are written.
        out_scales: uint8 [cap, M, P/16]; slots 0..n-1 are written.
    """
    n = check_conversion(packed, scales, experts, out_elements, out_scales)[0]
    experts = experts.long()
    out_elements[:n] = e2m1_values(packed[experts], torch.float32).to(torch.float8_e4m3fn)  # exact
    out_scales[:n] = scales[experts]


@op(kernel="mlp_triton", cpu="cpu",
    fake=lambda z, elements, scales, routing, beta_gate, beta_up, max_pairs=0: result_like(z, z.shape))
def expert_mlp_fp8(z: torch.Tensor, elements: torch.Tensor, scales: torch.Tensor, routing: torch.Tensor,
                       beta_gate: float, beta_up: float, max_pairs: int = 0) -> torch.Tensor:
    """Routed-expert MLPs over the FP8 workspace; slot j holds one expert.

    Args:
        z: [N, L] latent inputs (``routed_expert_down_proj(x)``).
        elements: float8_e4m3fn [cap, 3, I*L] workspace elements (w1, w3 [I, L]; w2 [L, I]).
        scales: uint8 [cap, 3, I*L/32] their E8M0 group scales.
        routing: [m, N] routing weight of token n for slot j (m <= cap), 0 = not routed.
        beta_gate, beta_up: SiTU-GLU clip widths.
        max_pairs: a bound on the routed (slot, token) pairs that sizes the kernels' buffers; unused here.
    Returns:
        y_lat [N, L] in fp32 (fp64 if z or routing is): sum_j routing[j, n] W2_j SiTU-GLU(W1_j z_n, W3_j z_n).
    """
    m = check_fp8_mlp(z, elements, scales, routing)[3]
    acc = acc_dtype(z, routing)
    w = scaled(elements[:m].to(acc), scales[:m])  # exact: every e4m3 value is a float
    return expert_mlp(cast(z, acc), w, cast(routing, acc), beta_gate, beta_up)


@op(kernel="mlp_triton", cpu="cpu",
    fake=lambda z, packed, scales, experts, routing, beta_gate, beta_up: result_like(z, z.shape))
def expert_mlp_mxfp4(z: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                         routing: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    """``expert_mlp_fp8_ref`` with the weights read straight from MXFP4 storage, no workspace.

    Args:
        z: [N, L]; packed: uint8 [E, 3, I*L/2]; scales: uint8 [E, 3, I*L/32] (``RoutedExperts.packed`` /
        ``scales``); experts: integer [m], slot j computes expert experts[j]; routing: [m, N]
        (0 = not routed); beta_gate, beta_up: SiTU-GLU clip widths.
    Returns:
        y_lat [N, L] fp32 (fp64 if z or routing is), equal to ``expert_mlp_fp8_ref`` after
        ``mxfp4_to_fp8_ref`` of the same experts.
    """
    check_mxfp4_mlp(z, packed, scales, experts, routing)
    acc = acc_dtype(z, routing)
    experts = experts.long()
    w = scaled(e2m1_values(packed[experts], acc), scales[experts])  # [m, 3, I*L], exact
    return expert_mlp(cast(z, acc), w, cast(routing, acc), beta_gate, beta_up)


# The plain references by the names the kernels' fallbacks and the tests call them.
mxfp4_to_fp8_ref = mxfp4_to_fp8.reference
expert_mlp_fp8_ref = expert_mlp_fp8.reference
expert_mlp_mxfp4_ref = expert_mlp_mxfp4.reference
