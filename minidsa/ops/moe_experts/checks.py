"""Argument checks of the routed-expert ops, shared by the reference, the CPU forms and the kernels.

Shapes and dtypes are always checked; expert ids only where reading them costs no device sync (``on_host``).
"""

from __future__ import annotations

import torch

from ...formats.mxfp4 import GROUP
from .._checks import check_tensor, on_host


def check_experts(experts, num: int) -> int:
    """``experts`` integer [n], ids in [0, num) (values checked on the host) -> n."""
    n = check_tensor("experts", experts, ndim=1, integer=True)[0]
    if on_host(experts) and n:
        lo, hi = experts.aminmax()  # one pass for both bounds
        if int(lo) < 0 or int(hi) >= num:
            raise ValueError(f"experts holds ids outside [0, {num}): {experts.tolist()}")
    return n


def check_block(name: str, t, dtype: torch.dtype, shape: tuple) -> tuple[int, ...]:
    """``t`` of ``shape`` (None matches any size) and exactly ``dtype`` -> its shape."""
    got = check_tensor(name, t, shape=shape)
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    return got


def check_conversion(packed, scales, experts, out_elements, out_scales) -> tuple[int, int, int]:
    """Argument checks of ``mxfp4_to_fp8``: returns (n experts, M matrices per expert, P bytes per matrix)."""
    E, M, P = check_block("packed", packed, torch.uint8, (None, None, None))
    if P % (GROUP // 2):
        raise ValueError(f"packed has {P} bytes per matrix; MXFP4 needs a multiple of {GROUP // 2}")
    check_block("scales", scales, torch.uint8, (E, M, P * 2 // GROUP))
    n = check_experts(experts, E)
    cap = check_block("out_elements", out_elements, torch.float8_e4m3fn, (None, M, 2 * P))[0]
    check_block("out_scales", out_scales, torch.uint8, (cap, M, P * 2 // GROUP))
    if n > cap:
        raise ValueError(f"{n} experts do not fit a workspace of {cap} slots")
    return n, M, P


def check_mlp_inputs(z, routing, per_element: int, width: int) -> tuple[int, int, int, int]:
    """Shapes (N, L, I, m) of the MLP ops' shared arguments; ``width`` is the stored row of one matrix."""
    N, L = check_tensor("z", z, ndim=2, floating=True)
    m = check_tensor("routing", routing, shape=(None, N), floating=True)[0]
    if L == 0 or L % GROUP:
        raise ValueError(f"z has latent width {L}; MXFP4 experts need a positive multiple of {GROUP}")
    if (width * per_element) % L or (width * per_element // L) % GROUP:
        raise ValueError(f"an expert matrix of {width * per_element} elements is not I x {L} with I a multiple "
                         f"of {GROUP}")
    return N, L, width * per_element // L, m


def check_fp8_mlp(z, elements, scales, routing) -> tuple[int, int, int, int]:
    """Argument checks of ``expert_mlp_fp8``: returns (N, L, I, m)."""
    cap, _, width = check_block("elements", elements, torch.float8_e4m3fn, (None, 3, None))
    N, L, I, m = check_mlp_inputs(z, routing, 1, width)
    check_block("scales", scales, torch.uint8, (cap, 3, width // GROUP))
    if m > cap:
        raise ValueError(f"routing has {m} slots but the workspace holds {cap}")
    return N, L, I, m


def check_mxfp4_mlp(z, packed, scales, experts, routing) -> tuple[int, int, int, int]:
    """Argument checks of ``expert_mlp_mxfp4``: returns (N, L, I, m)."""
    E, _, width = check_block("packed", packed, torch.uint8, (None, 3, None))
    N, L, I, m = check_mlp_inputs(z, routing, 2, width)
    check_block("scales", scales, torch.uint8, (E, 3, 2 * width // GROUP))
    if check_experts(experts, E) != m:
        raise ValueError(f"experts has {experts.shape[0]} entries but routing has {m} slots")
    return N, L, I, m
