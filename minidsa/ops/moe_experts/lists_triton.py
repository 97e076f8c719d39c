"""The compact (prefill) layout's lists of routed tokens, built in three launches (``mlp_triton.py``).

From routing [m, N] (0 = not routed), slot j's routed tokens, ascending, are listed from ``offset[j]``;
``rank[j, t]`` counts slot j's routed tokens up to and including token t (what the combine pass reads to
find a pair's row); the slots' token tiles form one list whose running ends are ``tile_end``. As torch ops
that is about a dozen launches per MoE layer (cumulative sums, a scatter, an assertion and their
temporaries), a share of a prefill forward's launches. Here:

1. ``_block_counts_kernel``, per block of BLOCK_N tokens: each slot's routed tokens in the block.
2. ``_offsets_kernel``, one program: walking the blocks in order, each block's running count per slot
   (written over its counts), then per slot the total, the list offset and the tile list's end, and the
   check that the pairs fit the caller's bound.
3. ``_lists_kernel``, per block: ranks (the block's running count plus a cumulative sum inside the block)
   and the token lists.
Integers only: the result is exactly the torch expressions' (tests/ops/test_triton_moe.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["m", "N"])
def _block_counts_kernel(routing_ptr, counts_ptr, m, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """counts[b, j] = tokens of block b routed to slot j."""
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK_M)
    n = b * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (j < m)[:, None] & (n < N)[None, :]
    g = tl.load(routing_ptr + j[:, None].to(tl.int64) * N + n[None, :], mask=ok, other=0.0)
    tl.store(counts_ptr + b * BLOCK_M + j, tl.sum((g != 0).to(tl.int32), axis=1))


@triton.jit(do_not_specialize=["m", "n_blocks", "max_pairs"])
def _offsets_kernel(counts_ptr, count_ptr, offset_ptr, tile_end_ptr, fits_ptr, m, n_blocks, max_pairs,
                    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr):
    """counts [n_blocks, BLOCK_M] -> the tokens before each block per slot (in place); count, offset, tile_end
    [m]; fits: whether the pairs stay within max_pairs (0: no bound)."""
    j = tl.arange(0, BLOCK_M)
    run = tl.zeros([BLOCK_M], tl.int32)
    for b in range(0, n_blocks):
        c = tl.load(counts_ptr + b * BLOCK_M + j)
        tl.store(counts_ptr + b * BLOCK_M + j, run)
        run += c
    ok = j < m
    tl.store(count_ptr + j, run, mask=ok)
    tl.store(offset_ptr + j, tl.cumsum(run, axis=0) - run, mask=ok)
    tl.store(tile_end_ptr + j, tl.cumsum((run + BLOCK_T - 1) // BLOCK_T, axis=0), mask=ok)
    total = tl.sum(run, axis=0)
    tl.store(fits_ptr, (max_pairs == 0) | (total <= max_pairs))


@triton.jit(do_not_specialize=["m", "N"])
def _lists_kernel(routing_ptr, before_ptr, offset_ptr, rank_ptr, token_ptr, m, N, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """rank[j, t] (inclusive count of slot j's routed tokens up to t) for the block's tokens, and each routed
    token written into its slot's list."""
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK_M)
    n = b * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (j < m)[:, None] & (n < N)[None, :]
    row = j[:, None].to(tl.int64) * N + n[None, :]
    routed = (tl.load(routing_ptr + row, mask=ok, other=0.0) != 0).to(tl.int32)
    rank = tl.cumsum(routed, axis=1) + tl.load(before_ptr + b * BLOCK_M + j)[:, None]
    tl.store(rank_ptr + row, rank, mask=ok)
    dest = tl.load(offset_ptr + j, mask=j < m, other=0)[:, None] + rank - 1
    tl.store(token_ptr + dest, tl.broadcast_to(n[None, :], (BLOCK_M, BLOCK_N)), mask=ok & (routed == 1))


def compact_lists(routing: torch.Tensor, block_t: int, max_pairs: int = 0) -> tuple:
    """Per-slot lists of routed tokens and the token tiles that walk them: (rank int32 [m, N] inclusive, count
    int32 [m], offset int32 [m], token int32 [pairs + 1], tile_end int32 [m] (inclusive running sum of the
    slots' tiles of ``block_t`` tokens), pairs, a bound on the tiles). With ``max_pairs`` (a bound the caller
    knows, N * top_k) the buffers are sized by it and nothing is read back: a bound below the true count stops
    the device with an assertion. Without it the pair count is read back (one host synchronisation)."""
    m, N = routing.shape
    dev, on_gpu = routing.device, routing.is_cuda
    block_m = triton.next_power_of_2(m)
    block_n = max(16, min(256 if on_gpu else 32, 8192 // block_m))  # a [BLOCK_M, BLOCK_N] tile per program
    n_blocks = triton.cdiv(N, block_n)
    counts = torch.empty(n_blocks, block_m, dtype=torch.int32, device=dev)
    count, offset, tile_end = (torch.empty(m, dtype=torch.int32, device=dev) for _ in range(3))
    fits = torch.empty((), dtype=torch.bool, device=dev)
    _block_counts_kernel[(n_blocks,)](routing, counts, m, N, BLOCK_M=block_m, BLOCK_N=block_n)
    _offsets_kernel[(1,)](counts, count, offset, tile_end, fits, m, n_blocks, max_pairs, BLOCK_T=block_t,
                          BLOCK_M=block_m)
    if max_pairs > 0:
        torch._assert_async(fits, "expert_mlp_fp8: more routed pairs than max_pairs")
        pairs = max_pairs
    else:
        pairs = int(count.sum())
    rank = torch.empty(m, N, dtype=torch.int32, device=dev)
    token = torch.empty(pairs + 1, dtype=torch.int32, device=dev)
    _lists_kernel[(n_blocks,)](routing, counts, offset, rank, token, m, N, BLOCK_M=block_m, BLOCK_N=block_n)
    # sum over slots of ceil(count / block_t) <= pairs / block_t + m, and never more than every slot's N tokens
    tiles = min(triton.cdiv(pairs, block_t) + m, m * triton.cdiv(N, block_t))
    return rank, count, offset, token, tile_end, pairs, tiles
