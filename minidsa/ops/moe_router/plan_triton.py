"""Triton kernel of ``moe_plan``: the contract of ``moe_plan_ref`` in ``minidsa/ops/moe_router/reference.py``.

In plain torch the plan is nine launches (a mask, a sort, the count, then the routing matrix as a compare, a
product and a sum over a [m, N, top_k] temporary), a decode step's largest group of launches after the
projections. One program does it all for a decode-sized call: the routed mask by comparing the ids with
every expert lane in chunks, each expert's slot by prefix sums over the mask (routed first, then the
rest, both ascending), then the routing weights tile by tile, each the weight of the one id that names its
slot. No atomics, no sort. Above ``MAX_PAIRS`` (token, expert) pairs the single program would run too long:
a prefill's plan takes three launches of the same steps, the routed mask per block of tokens, one program
for the slots, the routing weights per block of tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_plan, moe_plan_ref

MAX_PAIRS = 2048  # 256 decode rows of top-8 routing; a prefill call above it runs the reference


@triton.jit
def _slot_map(routed, lanes, E, experts_ptr, count_ptr, slot_ptr, M):
    """From the routed mask [BLOCK_E] over expert lanes: each expert's slot (routed first, then the rest, both
    ascending), the slots' experts and the routed count."""
    real = lanes < E
    routed = tl.where(real, routed, 0)
    rest = tl.where(real, 1 - routed, 0)
    n_routed = tl.sum(routed, axis=0)
    slot = tl.where(routed == 1, tl.cumsum(routed, axis=0) - 1, n_routed + tl.cumsum(rest, axis=0) - 1)
    tl.store(experts_ptr + slot, lanes.to(tl.int64), mask=real & (slot < M))
    tl.store(count_ptr, n_routed.to(tl.int64))
    tl.store(slot_ptr + lanes, slot, mask=real)  # each expert's slot, read back by id for the routing


@triton.jit
def _gates_block(ids_ptr, w_ptr, slot_ptr, routing_ptr, n0, N, M, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """routing[:, n0:n0 + BLOCK_N]: each gate the weight of the one id of its token that names its slot."""
    n = n0 + tl.arange(0, BLOCK_N)
    for m0 in range(0, M, BLOCK_M):
        j = m0 + tl.arange(0, BLOCK_M)
        g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + n * TOP_K + k, mask=n < N, other=0)
            w = tl.load(w_ptr + n * TOP_K + k, mask=n < N, other=0.0).to(tl.float32)
            s = tl.load(slot_ptr + e, mask=n < N, other=-1)
            g += tl.where(j[:, None] == s[None, :], w[None, :], 0.0)
        tl.store(routing_ptr + j[:, None] * N + n[None, :], g, mask=(j < M)[:, None] & (n < N)[None, :])


# N and M = min(N * top_k, E) change with the batch: not specialised (no variant compiled mid-run)
@triton.jit(do_not_specialize=["N", "M"])
def _plan_kernel(ids_ptr, w_ptr, experts_ptr, routing_ptr, count_ptr, slot_ptr, N, E, M, TOP_K: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A decode-sized plan in one program."""
    lanes = tl.arange(0, BLOCK_E)
    routed = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, N * TOP_K, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + p, mask=p < N * TOP_K, other=-1)
        routed = tl.maximum(routed, tl.max((ids[:, None] == lanes[None, :]).to(tl.int32), axis=0))
    _slot_map(routed, lanes, E, experts_ptr, count_ptr, slot_ptr, M)
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK_N):
        _gates_block(ids_ptr, w_ptr, slot_ptr, routing_ptr, n0, N, M, TOP_K, BLOCK_M, BLOCK_N)


# A prefill-sized plan in three launches: per block of tokens the experts it names; one program for the slots;
# per block of tokens its routing.
@triton.jit(do_not_specialize=["N"])
def _block_routed_kernel(ids_ptr, routed_ptr, N, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_E)
    n = b * BLOCK_N + tl.arange(0, BLOCK_N)
    hit = tl.zeros([BLOCK_E], tl.int32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + n * TOP_K + k, mask=n < N, other=-1)
        hit = tl.maximum(hit, tl.max((e[:, None] == lanes[None, :]).to(tl.int32), axis=0))
    tl.store(routed_ptr + b * BLOCK_E + lanes, hit)


@triton.jit(do_not_specialize=["n_blocks", "M"])
def _slots_kernel(routed_ptr, experts_ptr, count_ptr, slot_ptr, n_blocks, E, M, BLOCK_E: tl.constexpr):
    lanes = tl.arange(0, BLOCK_E)
    routed = tl.zeros([BLOCK_E], tl.int32)
    for b in range(0, n_blocks):
        routed = tl.maximum(routed, tl.load(routed_ptr + b * BLOCK_E + lanes))
    _slot_map(routed, lanes, E, experts_ptr, count_ptr, slot_ptr, M)


@triton.jit(do_not_specialize=["N", "M"])
def _gates_kernel(ids_ptr, w_ptr, slot_ptr, routing_ptr, N, M, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    _gates_block(ids_ptr, w_ptr, slot_ptr, routing_ptr, tl.program_id(0) * BLOCK_N, N, M, TOP_K, BLOCK_M, BLOCK_N)


def moe_plan(ids: torch.Tensor, weights: torch.Tensor,
             num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract of ``moe_plan_ref``: (experts int64 [m], routing fp32 [m, N], num_routed int64 [])."""
    N, K = check_plan(ids, weights, num_experts)
    if weights.dtype == torch.float64 or N * K == 0:
        return moe_plan_ref(ids, weights, num_experts)
    M = min(N * K, num_experts)
    dev = ids.device
    experts = torch.empty(M, dtype=torch.int64, device=dev)
    routing = torch.empty(M, N, dtype=torch.float32, device=dev)
    count = torch.empty((), dtype=torch.int64, device=dev)
    slots = torch.empty(num_experts, dtype=torch.int32, device=dev)  # scratch: each expert's slot
    block_e = triton.next_power_of_2(num_experts)
    ids, weights = ids.contiguous(), weights.contiguous()
    block_m = min(64, triton.next_power_of_2(M))
    if N * K <= MAX_PAIRS:
        _plan_kernel[(1,)](ids, weights, experts, routing, count, slots, N, num_experts, M, TOP_K=K, BLOCK_E=block_e,
                           BLOCK_P=max(1, min(64, 8192 // block_e)), BLOCK_M=block_m,
                           BLOCK_N=min(32, triton.next_power_of_2(N)), num_warps=4)
        return experts, routing, count
    block_n = max(1, min(64, 8192 // block_e))
    n_blocks = triton.cdiv(N, block_n)
    routed = torch.empty(n_blocks, block_e, dtype=torch.int32, device=dev)
    _block_routed_kernel[(n_blocks,)](ids, routed, N, TOP_K=K, BLOCK_E=block_e, BLOCK_N=block_n)
    _slots_kernel[(1,)](routed, experts, count, slots, n_blocks, num_experts, M, BLOCK_E=block_e)
    _gates_kernel[(triton.cdiv(N, 32),)](ids, weights, slots, routing, N, M, TOP_K=K, BLOCK_M=block_m, BLOCK_N=32)
    return experts, routing, count
