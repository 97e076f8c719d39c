"""The routed-expert ops in a fast CPU form: same signatures and results as ``reference.py`` (the parity
tests hold them equal), chosen by the "auto" backend for CPU tensors (ops/_dispatch.py, CPU_FORMS).

Three things make the difference on a CPU, where a gather costs about the same at any width up to 16 bytes
and a small matrix product is mostly call overhead:
- lookup tables that turn one gather into several elements: two packed MXFP4 bytes into four e4m3 bytes
  (the workspace conversion), one packed byte into its two values, two e4m3 bytes into two fp32 values;
- the group scales applied as one long [groups, 32] x [groups, 1] product, in place;
- at prefill, each expert's MLP run on the tokens routed to it only (``_routed_rows``), not densely over
  every (expert, token) pair as the reference (and a CUDA graph's fixed shapes) do.
The results are the reference's values; only the order of a token's additions across experts may differ
(the routed rows add a token's terms in expert order, as the dense sum does, through an index_add).
"""

from __future__ import annotations

import functools

import torch

from ...formats.mxfp4 import GROUP, byte_pair_to_fp8_quad, e2m1_table, e8m0_to_float, table_lookup
from ...formats.mxfp4 import fp8_values as _e4m3_values
from .._checks import acc_dtype, cast, on_host
from ..activation.reference import situ_glu_values
from .checks import check_conversion, check_fp8_mlp, check_mxfp4_mlp

ROUTED_ROWS_MIN_TOKENS = 8  # below this (small decode batches) one dense matmul per weight beats the grouped form
GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None)  # torch >= 2.9 (CPU: fp32, bf16, fp16)


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


@functools.lru_cache(maxsize=None)
def _tables(device, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """[256] e4m3 values and [256] E8M0 values (0xFF = NaN, as at load), exact in ``dtype`` (fp32 or fp64)."""
    with torch.inference_mode(False):
        fp8 = _e4m3_values().double()
        e8m0 = e8m0_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8), torch.float64, check=False)
        return tuple(t.to(device=device, dtype=dtype) for t in (fp8, e8m0))


def _mxfp4_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., P] packed codes -> their values [..., 2P] in ``dtype`` (fp32 or fp64), one gather per byte."""
    table = _e2m1_pairs(codes.device, dtype)
    pairs = table.index_select(0, codes.reshape(-1).int())
    return pairs.view(dtype).view(codes.shape[:-1] + (2 * codes.shape[-1],))


def fp8_values(elements: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn elements [..., K] -> their values [..., K] in table's dtype (table [256]: value per byte).
    fp32 looks up two elements at a time (half the gathers; the same values)."""
    if table.dtype == torch.float32 and elements.shape[-1] % 2 == 0:
        pairs = _fp32_pairs().index_select(0, elements.contiguous().view(torch.uint16).reshape(-1).int())
        return pairs.view(torch.float32).view(elements.shape)
    return table_lookup(table, elements.view(torch.uint8))


def _apply_scales(values: torch.Tensor, group_scales: torch.Tensor) -> None:
    """In place: values [m, 3, I*L] times their group's scale (group_scales [m, 3, I*L/32]), exact.
    Viewed as [groups, 32] x [groups, 1]: the same products, about 3x faster than the 4-d broadcast."""
    values.view(-1, GROUP).mul_(group_scales.reshape(-1, 1))


def mxfp4_to_fp8(packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                 out_elements: torch.Tensor, out_scales: torch.Tensor) -> None:
    """``mxfp4_to_fp8_ref``: one lookup per two packed bytes writes their four elements (an int32 = four
    e4m3 bytes in memory order), straight into the slots when they are one contiguous run."""
    n = check_conversion(packed, scales, experts, out_elements, out_scales)[0]
    experts = experts.long()
    codes = packed.index_select(0, experts)  # [n, M, P], P a multiple of 16
    quads, dest = byte_pair_to_fp8_quad(packed.device), out_elements[:n]
    index = codes.view(torch.uint16).view(-1).int()
    if dest.is_contiguous() and dest.storage_offset() % 4 == 0:
        torch.index_select(quads, 0, index, out=dest.view(torch.int32).view(-1))
    else:
        dest.view(torch.uint8).copy_(quads.index_select(0, index).view(torch.uint8).view(dest.shape))
    torch.index_select(scales, 0, experts, out=out_scales[:n])


def _expert_mlp(z: torch.Tensor, values: torch.Tensor, routing: torch.Tensor, beta_gate: float,
                beta_up: float) -> torch.Tensor:
    """z [N, L], values [m, 3, I*L] (w1, w3 [I, L]; w2 [L, I]), routing [m, N], one float dtype -> y_lat [N, L]."""
    L = z.shape[1]
    I = values.shape[-1] // L
    w13 = values[:, :2].reshape(values.shape[0], 2 * I, L)  # w1 rows, then w3 rows: one matmul for both
    w2 = values[:, 2].unflatten(-1, (L, I))
    if on_host(z, routing) and z.shape[0] >= ROUTED_ROWS_MIN_TOKENS and 2 * int((routing != 0).sum()) < routing.numel():
        return _routed_rows(z, w13, w2, routing, beta_gate, beta_up)
    gu = z @ w13.mT  # [m, N, 2I]
    h = situ_glu_values(gu[..., :I], gu[..., I:], beta_gate, beta_up)  # [m, N, I]
    return ((h * routing.unsqueeze(-1)) @ w2.mT).sum(0)  # [m, N, L] summed over slots in one reduction


def _routed_rows(z, w13, w2, routing, beta_gate: float, beta_up: float) -> torch.Tensor:
    """The sum over the slots, each slot's MLP run on the tokens routed to it only. At prefill most of the
    dense form's rows have gate 0. The routed (slot, token) pairs are gathered once, grouped by slot: two
    matrix products per slot, the activation and the routing weights once over all pairs, and one index_add that adds
    a token's terms in slot order, as the dense form's reduction adds them (its other terms are exact zeros)."""
    I = w2.shape[-1]
    slot, rows = routing.nonzero(as_tuple=True)  # row-major over [m, N]: grouped by slot, tokens ascending
    counts = torch.bincount(slot, minlength=routing.shape[0])
    gu = grouped_products(z.index_select(0, rows), w13, counts)  # [pairs, 2I]
    h = situ_glu_values(gu[:, :I], gu[:, I:], beta_gate, beta_up) * routing[slot, rows].unsqueeze(-1)
    return z.new_zeros(z.shape).index_add_(0, rows, grouped_products(h, w2, counts))


def grouped_products(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [pairs, K], its rows grouped by slot (counts int [m]: rows of each slot, in slot order), w [m, R, K]
    -> each group's x_j @ w[j]^T, [pairs, R]. One ``grouped_mm`` call where torch has it for the dtype (fp32,
    bf16): the same values as a product per slot, without a call's overhead per slot, which is most of a small
    product's cost on a CPU. Else a product per slot."""
    global GROUPED_MM
    if GROUPED_MM is not None and x.dtype in (torch.float32, torch.bfloat16):
        try:
            return GROUPED_MM(x, w.mT, offs=counts.cumsum(0).to(torch.int32))
        except (RuntimeError, NotImplementedError):  # a torch whose grouped_mm has no CPU kernel: asked once
            GROUPED_MM = None
    parts = x.split(counts.tolist())
    return torch.cat([part @ w[j].mT for j, part in enumerate(parts) if part.shape[0]])


def expert_mlp_fp8(z: torch.Tensor, elements: torch.Tensor, scales: torch.Tensor, routing: torch.Tensor,
                   beta_gate: float, beta_up: float, max_pairs: int = 0) -> torch.Tensor:
    """``expert_mlp_fp8_ref``; ``max_pairs`` (a kernel's buffer bound) is not needed here."""
    m = check_fp8_mlp(z, elements, scales, routing)[3]
    acc = acc_dtype(z, routing)
    fp8, e8m0 = _tables(z.device, acc)
    values = fp8_values(elements[:m], fp8)  # exact: every e4m3 value is a float
    _apply_scales(values, table_lookup(e8m0, scales[:m]))
    return _expert_mlp(cast(z, acc), values, cast(routing, acc), beta_gate, beta_up)


def expert_mlp_mxfp4(z: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                     routing: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    """``expert_mlp_mxfp4_ref``, decoding the packed bytes through the pair table."""
    check_mxfp4_mlp(z, packed, scales, experts, routing)
    acc = acc_dtype(z, routing)
    e8m0 = _tables(z.device, acc)[1]
    experts = experts.long()
    values = _mxfp4_values(packed.index_select(0, experts), acc)  # [m, 3, I*L], exact
    _apply_scales(values, table_lookup(e8m0, scales.index_select(0, experts)))
    return _expert_mlp(cast(z, acc), values, cast(routing, acc), beta_gate, beta_up)
