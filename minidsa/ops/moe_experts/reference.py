"""Reference ops of the routed latent experts: MXFP4 -> FP8 conversion into the shared workspace, and
the routed-expert MLPs over FP8 workspace slots or straight from MXFP4 (docs/design.md §6, §7, §12).

Storage (one contiguous block per expert, ``LatentMoE.experts_packed`` / ``experts_scale``):

    packed   uint8 [E, 3, I*L/2]   E2M1 codes of w1, w3 ([I, L] each) and w2 ([L, I]), row-major;
                                   the LOW nibble holds the even (lower-index) element
    scales   uint8 [E, 3, I*L/32]  one E8M0 exponent 2^(s - 127) per 32 consecutive elements of a row
    elements float8_e4m3fn [cap, 3, I*L]   the FP8 workspace (``ExpertWorkspace``), scales beside it

Every E2M1 value is exact in e4m3 and every (value * 2^(s-127)) product is exact in fp32, so the
three ops see identical weight values; the two MLP ops share one plain-torch core
(``_expert_mlp_core``) and differ only in where the values come from. That core is, operation for
operation, what ``LatentMoE.forward`` computes, so it reproduces the layer's routed output:

    h_m    = SiTU-GLU(z W1_m^T, z W3_m^T)           [m, N, I]   dense over slots (docs/design.md §14)
    y_lat  = sum_m (gates[m, :, None] * h_m) W2_m^T  [N, L]

The E2M1, e4m3 and E8M0 tables and the byte-pair lookup are those of ``minidsa.formats.mxfp4``.
"""

from __future__ import annotations

import functools

import torch

from ...formats.mxfp4 import GROUP, _byte_pair_to_fp8_quad, _lookup, e2m1_table, e8m0_to_float
from ...formats.mxfp4 import _fp8_values as _e4m3_values
from .._checks import acc_dtype, cast, check_tensor, on_host
from ..activation.reference import situ_glu_values


@functools.lru_cache(maxsize=None)
def _fp32_pairs() -> torch.Tensor:
    """int64 [65536]: for every 2-byte pattern (read as uint16), the fp32 values of its two e4m3 bytes in
    memory order, packed in 8 bytes."""
    fp8 = _e4m3_values()
    with torch.inference_mode(False):
        byte_pairs = torch.arange(65536, dtype=torch.int32).to(torch.uint16).view(torch.uint8).view(-1, 2)
        return fp8[byte_pairs.long()].contiguous().view(torch.int64).view(-1)


@functools.lru_cache(maxsize=None)
def _e2m1_pairs(device, dtype: torch.dtype) -> torch.Tensor:
    """[256] int64 (fp32) or [256, 2] (fp64): for every packed byte, the values of its two E2M1 codes, low
    nibble (the even element) first. 2 kB in fp32: the gather's table stays in the L1 cache."""
    e2m1 = e2m1_table(torch.float64)
    with torch.inference_mode(False):
        byte = torch.arange(256)
        pairs = torch.stack([e2m1[byte & 0x0F], e2m1[byte >> 4]], dim=-1).to(device=device, dtype=dtype)
        return pairs.view(torch.int64).view(-1) if dtype == torch.float32 else pairs


def _mxfp4_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., P] packed codes -> their values [..., 2P] in ``dtype`` (fp32 or fp64), one gather per byte."""
    table = _e2m1_pairs(codes.device, dtype)
    pairs = table.index_select(0, codes.reshape(-1).int())
    return pairs.view(dtype).view(codes.shape[:-1] + (2 * codes.shape[-1],))


def _fp8_values(elements: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn elements [..., K] -> their values [..., K] in table's dtype (table [256]: value per byte).
    fp32 on the CPU looks up two elements at a time (half the gathers; the same values)."""
    if table.dtype == torch.float32 and elements.device.type == "cpu" and elements.shape[-1] % 2 == 0:
        pairs = _fp32_pairs().index_select(0, elements.contiguous().view(torch.uint16).reshape(-1).int())
        return pairs.view(torch.float32).view(elements.shape)
    return _lookup(table, elements.view(torch.uint8))


@functools.lru_cache(maxsize=None)
def _tables(device, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[16] E2M1 values, [256] e4m3 values, [256] E8M0 values (0xFF = NaN, as at load), all exact in
    ``dtype`` (fp32 or fp64), built once per device and dtype."""
    with torch.inference_mode(False):
        e2m1 = e2m1_table(torch.float64)
        fp8 = _e4m3_values().double()
        e8m0 = e8m0_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8), torch.float64, check=False)
        return tuple(t.to(device=device, dtype=dtype) for t in (e2m1, fp8, e8m0))


def _check_experts(experts, num: int) -> int:
    n = check_tensor("experts", experts, ndim=1, integer=True)[0]
    if on_host(experts) and n:
        lo, hi = experts.aminmax()  # one pass for both bounds
        if int(lo) < 0 or int(hi) >= num:
            raise ValueError(f"experts holds ids outside [0, {num}): {experts.tolist()}")
    return n


def _check_block(name: str, t, dtype: torch.dtype, shape: tuple) -> tuple[int, ...]:
    got = check_tensor(name, t, shape=shape)
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    return got


def check_conversion(packed, scales, experts, out_elements, out_scales) -> tuple[int, int, int]:
    """Argument checks of ``mxfp4_to_fp8``: returns (n experts, M matrices per expert, P bytes per matrix)."""
    E, M, P = _check_block("packed", packed, torch.uint8, (None, None, None))
    if P % (GROUP // 2):
        raise ValueError(f"packed has {P} bytes per matrix; MXFP4 needs a multiple of {GROUP // 2}")
    _check_block("scales", scales, torch.uint8, (E, M, P * 2 // GROUP))
    n = _check_experts(experts, E)
    cap = _check_block("out_elements", out_elements, torch.float8_e4m3fn, (None, M, 2 * P))[0]
    _check_block("out_scales", out_scales, torch.uint8, (cap, M, P * 2 // GROUP))
    if n > cap:
        raise ValueError(f"{n} experts do not fit a workspace of {cap} slots")
    return n, M, P


def mxfp4_to_fp8_ref(packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                     out_elements: torch.Tensor, out_scales: torch.Tensor) -> None:
    """In place: the experts listed in ``experts`` converted into workspace slots 0..n-1 (bit-exact).

    Args:
        packed: uint8 [E, M, P] E2M1 codes, two per byte, low nibble = even element (M = 3 in LatentMoE).
        scales: uint8 [E, M, P/16] E8M0 group scales (copied unchanged).
        experts: integer [n] expert ids; slot j receives expert experts[j].
        out_elements: float8_e4m3fn [cap, M, 2P], n <= cap; slots 0..n-1 are written.
        out_scales: uint8 [cap, M, P/16]; slots 0..n-1 are written.
    Equals ``mxfp4.to_fp8`` of the selected experts plus ``index_select`` of their scales
    (``ExpertWorkspace.load``).
    """
    n, M, P = check_conversion(packed, scales, experts, out_elements, out_scales)
    experts = experts.long()
    codes = packed.index_select(0, experts)  # [n, M, P]
    # one lookup per two packed bytes writes their four elements (an int32 = four e4m3 bytes in memory
    # order), straight into the slots when they are one contiguous run; P is a multiple of 16
    quads, dest = _byte_pair_to_fp8_quad(packed.device), out_elements[:n]
    index = codes.view(torch.uint16).view(-1).int()
    if dest.is_contiguous() and dest.storage_offset() % 4 == 0:
        torch.index_select(quads, 0, index, out=dest.view(torch.int32).view(-1))
    else:
        dest.view(torch.uint8).copy_(quads.index_select(0, index).view(torch.uint8).view(dest.shape))
    torch.index_select(scales, 0, experts, out=out_scales[:n])


def _apply_scales(values: torch.Tensor, group_scales: torch.Tensor) -> None:
    """In place: values [m, 3, I*L] times their group's scale (group_scales [m, 3, I*L/32]), exact.
    Viewed as [groups, 32] x [groups, 1]: the same products, about 3x faster on a CPU than the 4-d
    broadcast (one long outer loop instead of three nested ones)."""
    values.view(-1, GROUP).mul_(group_scales.reshape(-1, 1))


def _expert_mlp_core(z: torch.Tensor, values: torch.Tensor, gates: torch.Tensor, beta_gate: float,
                     beta_up: float) -> torch.Tensor:
    """z [N, L], values [m, 3, I*L] (w1, w3 [I, L]; w2 [L, I]), gates [m, N], all in one float dtype
    -> y_lat [N, L]: exactly the expression ``LatentMoE.forward`` evaluates, dense over the m slots."""
    L = z.shape[1]
    I = values.shape[-1] // L
    w13 = values[:, :2].reshape(values.shape[0], 2 * I, L)  # w1 rows, then w3 rows: one matmul for both
    w2 = values[:, 2].unflatten(-1, (L, I))
    if on_host(z, gates) and z.shape[0] >= ROUTED_ROWS_MIN_TOKENS and 2 * int((gates != 0).sum()) < gates.numel():
        return _routed_rows(z, w13, w2, gates, beta_gate, beta_up)
    gu = z @ w13.mT  # [m, N, 2I]
    h = situ_glu_values(gu[..., :I], gu[..., I:], beta_gate, beta_up)  # [m, N, I]
    return ((h * gates.unsqueeze(-1)) @ w2.mT).sum(0)  # [m, N, L] summed over slots in one reduction


ROUTED_ROWS_MIN_TOKENS = 8  # below this (small decode batches) one dense matmul per weight beats the grouped form


def _routed_rows(z, w13, w2, gates, beta_gate: float, beta_up: float) -> torch.Tensor:
    """The same sum over the slots, each slot's MLP run on the tokens routed to it only. On the host and
    for several tokens (a prefill) most of the dense form's rows have gate 0; there the dense form
    (fixed shapes, for graphs) would spend most of its time on them. The routed (slot, token) pairs are
    gathered once, grouped by slot: two matrix products per slot, the activation and the gates once over
    all pairs, and one scatter-add that adds a token's terms in slot order, as the dense form's reduction
    adds them (its other terms are exact zeros)."""
    I = w2.shape[-1]
    slot, rows = gates.nonzero(as_tuple=True)  # row-major over [m, N]: grouped by slot, tokens ascending
    counts = torch.bincount(slot, minlength=gates.shape[0]).tolist()
    used = [j for j, c in enumerate(counts) if c]
    zs = z.index_select(0, rows).split([counts[j] for j in used])
    gu = torch.cat([part @ w13[j].mT for j, part in zip(used, zs)])  # [pairs, 2I]
    h = situ_glu_values(gu[:, :I], gu[:, I:], beta_gate, beta_up) * gates[slot, rows].unsqueeze(-1)
    y = torch.cat([part @ w2[j].mT for j, part in zip(used, h.split([counts[j] for j in used]))])
    return z.new_zeros(z.shape).index_add_(0, rows, y)


def _check_mlp_inputs(z, gates, per_element: int, width: int) -> tuple[int, int, int, int]:
    """Shapes (N, L, I, m) of the MLP ops' shared arguments; ``width`` is the stored row of one matrix."""
    N, L = check_tensor("z", z, ndim=2, floating=True)
    m = check_tensor("gates", gates, shape=(None, N), floating=True)[0]
    if L == 0 or L % GROUP:
        raise ValueError(f"z has latent width {L}; MXFP4 experts need a positive multiple of {GROUP}")
    if (width * per_element) % L or (width * per_element // L) % GROUP:
        raise ValueError(f"an expert matrix of {width * per_element} elements is not I x {L} with I a multiple "
                         f"of {GROUP}")
    return N, L, width * per_element // L, m


def check_fp8_mlp(z, elements, scales, gates) -> tuple[int, int, int, int]:
    """Argument checks of ``expert_mlp_fp8``: returns (N, L, I, m)."""
    cap, _, width = _check_block("elements", elements, torch.float8_e4m3fn, (None, 3, None))
    N, L, I, m = _check_mlp_inputs(z, gates, 1, width)
    _check_block("scales", scales, torch.uint8, (cap, 3, width // GROUP))
    if m > cap:
        raise ValueError(f"gates has {m} slots but the workspace holds {cap}")
    return N, L, I, m


def check_mxfp4_mlp(z, packed, scales, experts, gates) -> tuple[int, int, int, int]:
    """Argument checks of ``expert_mlp_mxfp4``: returns (N, L, I, m)."""
    E, _, width = _check_block("packed", packed, torch.uint8, (None, 3, None))
    N, L, I, m = _check_mlp_inputs(z, gates, 2, width)
    _check_block("scales", scales, torch.uint8, (E, 3, 2 * width // GROUP))
    if _check_experts(experts, E) != m:
        raise ValueError(f"experts has {experts.shape[0]} entries but gates has {m} slots")
    return N, L, I, m


def expert_mlp_fp8_ref(z: torch.Tensor, elements: torch.Tensor, scales: torch.Tensor, gates: torch.Tensor,
                       beta_gate: float, beta_up: float, max_pairs: int = 0) -> torch.Tensor:
    """Routed-expert MLPs over the FP8 workspace; slot j holds one expert.

    Args:
        z: [N, L] latent inputs (``routed_expert_down_proj(x)``).
        elements: float8_e4m3fn [cap, 3, I*L] workspace elements (w1, w3 [I, L]; w2 [L, I]).
        scales: uint8 [cap, 3, I*L/32] their E8M0 group scales.
        gates: [m, N] routing weight of token n for slot j (m <= cap), 0 = not routed.
        beta_gate, beta_up: SiTU-GLU clip widths.
    Returns:
        y_lat [N, L] in fp32 (fp64 if z or gates is): sum_j gates[j, n] W2_j SiTU-GLU(W1_j z_n, W3_j z_n).
    """
    m = check_fp8_mlp(z, elements, scales, gates)[3]
    acc = acc_dtype(z, gates)
    _, fp8, e8m0 = _tables(z.device, acc)
    values = _fp8_values(elements[:m], fp8)  # exact: every e4m3 value is a float
    _apply_scales(values, _lookup(e8m0, scales[:m]))
    return _expert_mlp_core(cast(z, acc), values, cast(gates, acc), beta_gate, beta_up)


def expert_mlp_mxfp4_ref(z: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                         gates: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    """``expert_mlp_fp8_ref`` with the weights read straight from MXFP4 storage, no workspace.

    Args:
        z: [N, L]; packed: uint8 [E, 3, I*L/2]; scales: uint8 [E, 3, I*L/32] (``experts_packed`` /
        ``experts_scale``); experts: integer [m], slot j computes expert experts[j]; gates: [m, N]
        (0 = not routed); beta_gate, beta_up: SiTU-GLU clip widths.
    Returns:
        y_lat [N, L] fp32 (fp64 if z or gates is), equal to ``expert_mlp_fp8_ref`` after
        ``mxfp4_to_fp8_ref`` of the same experts.
    """
    check_mxfp4_mlp(z, packed, scales, experts, gates)
    acc = acc_dtype(z, gates)
    e8m0 = _tables(z.device, acc)[2]
    experts = experts.long()
    values = _mxfp4_values(packed.index_select(0, experts), acc)  # [m, 3, I*L], exact
    _apply_scales(values, _lookup(e8m0, scales.index_select(0, experts)))
    return _expert_mlp_core(z.to(acc), values, gates.to(acc), beta_gate, beta_up)
