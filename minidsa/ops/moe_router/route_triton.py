"""Triton kernel of ``moe_route``: the contract of ``moe_route_ref`` in ``minidsa/ops/moe_router/reference.py``.

A program holds one token's row of E affinities in registers and picks the top_k by repeated
arg-max: each round takes the largest biased score of every row (the lowest expert id among equals,
which is what the reference's stable descending sort yields), records its id and affinity, and masks it
out. top_k rounds over E lanes cost less than sorting E values, and the whole routing of a decode step
(sigmoid, bias, selection, renormalisation) is one launch. The sigmoid is ``1 / (1 + exp(-x))`` in fp32
as in the reference; a near-tie between two biased scores can still resolve differently on the last ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import ROUTER_EPS, check_route, moe_route_ref


@triton.jit(do_not_specialize=["N"])
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, N, E, stride_n, scaling, eps,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < N
    col_ok = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_n + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-x))
    biased = s + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    biased = tl.where(col_ok[None, :], biased, float("-inf"))
    picks = tl.arange(0, K_PAD)
    ids = tl.zeros((BLOCK_N, K_PAD), tl.int32)
    chosen = tl.zeros((BLOCK_N, K_PAD), tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(biased, axis=1)
        idx = tl.min(tl.where(biased == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == idx[:, None]
        ids = tl.where(picks[None, :] == j, idx[:, None], ids)
        chosen = tl.where(picks[None, :] == j, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], chosen)
        biased = tl.where(hit, float("-inf"), biased)
    if RENORM:
        chosen = chosen / (tl.sum(chosen, axis=1)[:, None] + eps)
    out = rows[:, None].to(tl.int64) * TOP_K + picks[None, :]
    ok = row_ok[:, None] & (picks < TOP_K)[None, :]
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=ok)
    tl.store(w_ptr + out, chosen * scaling, mask=ok)


def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E], selection bias [E] -> (ids int64 [N, top_k], weights fp32 [N, top_k])."""
    N, E = check_route(logits, bias, top_k)
    if logits.dtype == torch.float64:  # exactness tests only
        return moe_route_ref(logits, bias, top_k, scaling)
    ids = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    if N == 0:
        return ids, weights
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # One token's row per program on one warp: each of the top_k rounds is three reductions over E, and
    # across warps every reduction would go through shared memory and a barrier.
    block_e = triton.next_power_of_2(E)
    block_n = 1
    _route_kernel[(triton.cdiv(N, block_n),)](logits, bias.contiguous(), ids, weights, N, E, logits.stride(0),
                                             float(scaling), ROUTER_EPS, TOP_K=top_k,
                                             K_PAD=triton.next_power_of_2(top_k), RENORM=top_k > 1,
                                             BLOCK_N=block_n, BLOCK_E=block_e, num_warps=1 if block_e <= 1024 else 4)
    return ids, weights
