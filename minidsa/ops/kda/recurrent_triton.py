"""Triton kernel of Kimi Delta Attention's fused recurrence, ``kda_recurrent`` (the decode path).

Same signature, layouts and results as ``kda_recurrent_ref`` in ``minidsa/ops/kda/reference.py``
(docs/design.md §5, §12): q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (value head j
reads q/k head j // (HV/H)); g [B, T, HV, K] log-decay; beta [B, T, HV]; state [B, HV, K, V] fp32.
The kernel computes in fp32 and returns a NEW fp32 state: the caller's ``initial_state`` is only read
(None means zeros). fp64 inputs (exactness tests only) go to the reference. No atomics: every output
element is written by exactly one program, so results are bitwise reproducible.

Grid ``(batch row x value head, tile of BLOCK_V state columns)``. A program holds its [K, BLOCK_V]
slice of the state in registers for all T steps and touches HBM for it exactly twice: one load at the
start, one store at the end. The delta rule never mixes state columns (every step is "scale rows,
rank-1 update, read with k or q"), so the V columns split into independent programs with no
communication, while the K rows cannot be split: the prediction S^T k sums over all of them. Per step
the program loads the token's k, q, g rows [K] and its v tile, and computes

    S <- S * exp(g)[:, None];  pred = sum_K(S * k);  S <- S + beta k (v - pred)^T;  o = sum_K(S * q)

with both sums as in-register reductions. Decode (T = 1, a batch of states) is therefore a pure
stream over the state: 2 * 4 * K * V bytes per head, read and written once, in rows of BLOCK_V
contiguous fp32 values (128 bytes at BLOCK_V = 32: whole cache lines). Small tiles give many programs
(batch 64 x 96 heads x 4 tiles = 24,576), enough to keep the H200's memory pipes full.

Binds: HBM bandwidth on the state bytes (decode reads and writes each state once and does little else).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_recurrence
from .io_triton import copy_state, load_state, new_outputs, token_row, wants_reference
from .reference import kda_recurrent_ref


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, o_ptr, s_ptr,
                      T, H, HV, K, V, REP, scale,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_S0: tl.constexpr):
    """One (batch row, value head, V tile): the state slice [BLOCK_K, BLOCK_V] stays in registers
    for all T steps; o [B, T, HV, V] is written per step, the final state once."""
    bh = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a batch of states may pass 2^31 values
    b, hv = bh // HV, bh % HV
    h = hv // REP  # grouped value heads share q/k head hv // (HV / H)
    d = tl.arange(0, BLOCK_K)
    e = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    S, state_offs, state_mask = load_state(s0_ptr, bh, K, V, d, e, BLOCK_K, BLOCK_V, HAS_S0)
    bT = b * T
    for t in range(T):
        k = token_row(k_ptr, bT, t, d < K, h, H, K, d)
        q = token_row(q_ptr, bT, t, d < K, h, H, K, d) * scale
        g = token_row(g_ptr, bT, t, d < K, hv, HV, K, d)
        v = token_row(v_ptr, bT, t, e < V, hv, HV, V, e)
        beta = tl.load(beta_ptr + (bT + t) * HV + hv).to(tl.float32)
        S = S * tl.exp(g)[:, None]  # padded rows: g = 0 keeps them at their 0
        pred = tl.sum(S * k[:, None], axis=0)  # S^T k: what the state already returns for k
        S = S + (beta * k)[:, None] * (v - pred)[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + ((bT + t) * HV + hv) * V + e, o.to(o_ptr.dtype.element_ty), mask=e < V)
    tl.store(s_ptr + state_offs, S, mask=state_mask)


def _recurrent_block_v(K: int, V: int, cuda: bool) -> int:
    """State columns per program. GPU: about 4096 state values per 4-warp program (32 fp32 registers
    a thread; 32 columns at K = 128, one 128-byte line per state row). Interpreter: one tile."""
    bv = triton.next_power_of_2(V)
    if not cuda:
        return bv
    return min(bv, max(16, 4096 // triton.next_power_of_2(K)))


def _launch_recurrent(q, k, v, g, beta, scale, initial_state, block_v=None):
    """Run the recurrence on checked, non-fp64 inputs. ``block_v`` overrides the V tile (tests)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o, state = new_outputs(q, v)
    if state.numel() == 0 or T == 0:  # nothing to run (K = 0 leaves o = S^T q = 0)
        return o.zero_(), copy_state(initial_state, state)
    bv = block_v or _recurrent_block_v(K, V, v.device.type == "cuda")
    s0 = initial_state.contiguous() if initial_state is not None else state  # placeholder when absent
    _recurrent_kernel[(B * HV, triton.cdiv(V, bv))](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), s0, o, state,
        T, H, HV, K, V, HV // H, scale,
        BLOCK_K=triton.next_power_of_2(K), BLOCK_V=bv, HAS_S0=initial_state is not None, num_warps=4)
    return o, state


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float | None = None,
                  initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step KDA, fused: returns (o [B, T, HV, V] in v.dtype, final_state [B, HV, K, V] fp32).

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] log-decay; beta [B, T, HV]; initial_state
    [B, HV, K, V] (read only; None = zeros). ``scale`` defaults to K^-0.5 and multiplies q.
    """
    check_recurrence(q, k, v, g, beta, initial_state)
    if wants_reference(q, k, v, g, beta, initial_state):
        return kda_recurrent_ref(q, k, v, g, beta, scale, initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _launch_recurrent(q, k, v, g, beta, scale, initial_state)
