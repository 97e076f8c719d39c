"""Sparse MLA attention on Hopper (sm_90) in Gluon: the Triton kernel's loop, with each warp group's role explicit.

Same math, grid, split scheme and row-number pass as ``mla_attention_triton._latent_attn_fwd`` (read that
first): one program per (query, block of 64 heads, split of the selected positions), absorbed form,
online softmax in fp32, invalid positions read a zero row and score -inf. Only the loop body differs.

Why a second kernel. In the Triton kernel the compiler gives a dot whose result feeds another dot all its
warps along M (``warpsPerTileV3``'s chained-dot rule). With 64 heads and 8 warps that is [8, 1]: both warp
groups compute the whole [64, 64] score tile, with half-width m64n32 instructions (76 wgmma per group per
64 positions, 1,107 SASS instructions per iteration). Gluon lets the kernel choose the layouts itself:

    scores  s = q @ kv^T          warps [4, 2]: each warp group computes 32 of the 64 columns (no copy)
    softmax row max / sum          across the two groups (the compiler exchanges the partial rows)
    p -> shared memory             both groups need the whole [64, 64] p as the wgmma A operand
    values  acc += p @ kv          warps [4, 2]: each warp group owns 256 of the 512 columns

That is 40 wgmma per group per 64 positions and 487 instructions per iteration (sm_90, counted in the SASS).

Warp specialization. The gathers run in a third warp group of their own (``_producer``, 56 registers per
thread; the two compute groups get 224). It copies tile `it` with 16-byte cp.async into stage it % STAGES of
a ring of NVMMA-swizzled tiles, and each thread's copies arrive on the stage's ``full`` mbarrier when they
land; the compute groups (``_consumer``) wait on ``full``, score, softmax, add the values, and arrive on the
stage's ``empty`` mbarrier, which lets the producer refill it. Shared memory: the query (72 KB), two [64, 576]
bf16 stages (2 x 72 KB) and p (8 KB) = 224 KB of the 227 KB a program may use: no room for a third stage.

Why. When the compute warps issued the copies themselves (the previous version of this kernel), a copy
instruction stalls its warp until the memory pipeline takes it, so each tile paid for its loads and its dots
one after the other. Measured on the H200 (one run, no split combine, time per 16-tile program): the dots
alone 2.0 us per 64 positions, the loads alone 0.8 us, both 3.15 us; the same for a cache of 65,536 random
rows and for 4,096 rows that sit in L2 (67.0 against 68.7 us), and per SM the same with 64 or 128 programs
running: not bandwidth, but the order of work inside one SM. With the producer the same call's attention
kernel takes 55.1 us instead of 68.6, and the output is bitwise the same.

Measured on the H200 (benchmarks/bench_mla.py: B=32, 65,536 cached, top-k 2048, 96 heads, r=512, dr=64, bf16,
GPU time from a CUDA graph, the row-number pass and the split combine included): 61-62 us (32.6 % of the
roofline), against 98 us for the Triton kernel and 74 us for this kernel without the producer. Of the
61-62 us the attention kernel takes 55 us, the row-number pass and the split combine the rest. Before the
producer, a program's fixed cost (query, first tile, storing its fp32 partial) was about 18 us of the 68.
Tried and rejected:
- before the producer: keeping the value wgmma in flight into the next iteration (84 us: the next tile's
  copy must then wait for it, since two stages share the ring), BLOCK_N=32 with 2-4 stages (96-110 us),
  3 or 4 splits (88-98 us), prefetching the rows 1-6 tiles ahead into L2 (79-83 us; the bulk form,
  cp.async.bulk.prefetch, takes uniform addresses and compiles to a loop over the threads), issuing the
  first tile before loading the query (no change);
- 40 producer registers: spills in the producer's loop, 1.7 us slower than 56;
- merging the splits in the attention kernel (the last program of a query, found with an atomic counter,
  merges all splits in split order: bitwise equal to the combine kernel): 64.2 against 62.1 us, since one
  SM then moves 384 KB at the tail while the combine kernel spreads it over the GPU;
- a combine kernel with 4 heads per program instead of 1: no difference (61.1-62.4 against 61.9-62.5 us).
With 64 heads the kernel would run one block per query; at 96 heads two blocks of 64 gather the same rows
and the second is half padding (the tensor-core work is 128/96 of the useful work).

Used by ``mla_attention_triton._latent_attention`` when ``gluon_fits`` says so (sm_90, bf16/fp16 planes,
r 256 or 512, dr a power of two in 16..256 with r + dr <= 576, more than 32 heads, planes under 2^31
elements); everything else, and every CPU run, takes the Triton kernel. Gluon has no interpreter: this
kernel is tested on the GPU only (tests/test_mla_gluon.py, through the device tool), against the same reference.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

# Compile-time constants of the kernels (the host reads them through int()).
BLOCK_H = gl.constexpr(64)  # one wgmma M per warp group
BLOCK_N = gl.constexpr(64)  # positions per iteration
STAGES = gl.constexpr(2)  # gathered tiles in flight: all that fits beside the query (see above)
PRODUCER_WARPS = gl.constexpr(4)  # the gathering partition: one warp group (setmaxnreg works per warp group)
PRODUCER_REGS = gl.constexpr(56)  # its registers per thread (40 spilled); the 8 consumer warps get 224
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one program may use on sm_90


@functools.lru_cache(maxsize=None)
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)  # cached: 5.6 us per query on the H200 host


def gluon_fits(q_latent: torch.Tensor, kv_plane: torch.Tensor, pe_plane: torch.Tensor, H: int) -> bool:
    """Whether this kernel handles the call (else the Triton kernel does)."""
    R, DR = kv_plane.shape[-1], pe_plane.shape[-1]
    if kv_plane.device.type != "cuda" or not _is_sm90(kv_plane.device.index):
        return False
    if kv_plane.dtype not in (torch.bfloat16, torch.float16) or pe_plane.dtype != kv_plane.dtype:
        return False
    if H <= 32:  # fewer heads would leave most of the 64 rows padding
        return False
    # r/2 is each warp group's wgmma N (at most 256); the copy layouts assume widths of whole 16-byte vectors.
    widths_ok = R in (256, 512) and DR in (16, 32, 64, 128, 256)
    bh, bn, stages = int(BLOCK_H), int(BLOCK_N), int(STAGES)
    smem = 2 * (bh * (R + DR) + stages * bn * (R + DR) + bh * bn) + 16 * stages  # + the mbarriers
    return widths_ok and smem <= SMEM_LIMIT and max(kv_plane.numel(), pe_plane.numel()) < 2**31


@triton.constexpr_function
def _nvmma(shape, dtype):
    """The swizzled shared layout wgmma reads (the widest swizzle the row allows)."""
    return gl.NVMMASharedLayout.get_default_for(shape, dtype)


@gluon.jit
def _gather_to_smem(rows_ptr, n0, end, plane_ptr, zero_ptr, stride, buf, W: gl.constexpr, BLOCK: gl.constexpr,
                    layout: gl.constexpr):
    """cp.async rows n0..n0+BLOCK of one plane into buf [BLOCK, W]: 16-byte copies, the zero row where the
    row number is -1 or the position is past ``end`` (int32 offsets: planes under 2^31 elements)."""
    n = n0 + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    r = gl.load(rows_ptr + n, mask=n < end, other=-1)
    ptr = gl.where(r >= 0, plane_ptr + r * stride, zero_ptr)
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    cp.async_copy_global_to_shared(buf, ptr[:, None] + cols[None, :])


@gluon.jit
def _query_to_smem(q_ptr, hoff, h0, H, W: gl.constexpr, layout: gl.constexpr, q_smem):
    """The [BLOCK_H, W] query block (padded heads: 0) into q_smem, in the planes' dtype (the Triton kernel
    rounds q the same way)."""
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    q = gl.load(q_ptr + heads.to(gl.int64)[:, None] * hoff + cols[None, :], mask=(heads < H)[:, None], other=0.0)
    q_smem.store(q.to(q_smem.dtype))


@gluon.jit
def _scores(q_smem, qpe_smem, kv_t, pe_t, s_zero):
    """q @ kv^T + q_pe @ pe^T [BLOCK_H, BLOCK_N] fp32 (the tiles' transposed views are the B operands)."""
    s = warpgroup_mma(qpe_smem, pe_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma_wait(0, deps=(warpgroup_mma(q_smem, kv_t.permute((1, 0)), s, is_async=True),))


@gluon.jit
def _softmax_to_smem(s, valid, m_i, l_acc, qk_scale, p_smem):
    """Online-softmax step on the raw scores s [BLOCK_H, BLOCK_N]; writes p to p_smem for the value wgmma.
    Returns (alpha, m, l_acc) once all of p is in p_smem. The row sums stay per column (l_acc, summed after
    the loop): a row sum per iteration would cost a second exchange between the warp groups. The
    reference point m_safe = 0 of a row with no valid key keeps 2^-inf = 0."""
    s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()  # a generic-proxy write that wgmma (async proxy) reads next
    gl.thread_barrier()  # both warp groups' halves of p are in shared memory
    return alpha, m_new, l_acc * alpha[:, None] + p


@gluon.jit
def _store_result(acc, m_i, l_i, o_ptr, m_ptr, l_ptr, o_base, ml_base, h0, H, s_oh, R: gl.constexpr,
                  NUM_SPLITS: gl.constexpr, o_layout: gl.constexpr, s_layout: gl.constexpr):
    """o = acc / l (one split), or the split's acc, m and l for _combine_splits."""
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, R, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = o_ptr + o_base + heads.to(gl.int64)[:, None] * s_oh + cols[None, :]
    if NUM_SPLITS == 1:  # a row with no valid position has l = 0, acc = 0: divide by 1, stay zero
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        o = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
        gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=(heads < H)[:, None])
    else:
        gl.store(o_ptrs, acc, mask=(heads < H)[:, None])
        hm = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
        gl.store(m_ptr + ml_base + hm, m_i, mask=hm < H)
        gl.store(l_ptr + ml_base + hm, l_i, mask=hm < H)


@gluon.jit
def _wait_for_previous_kernel():
    """griddepcontrol.wait: the kernel before this one (launched as its programmatic dependent) has completed and
    its writes are visible. Everything before this call may only read what older kernels wrote."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _producer(rows, start, end, kv_ptr, pe_ptr, zero_ptr, s_kv, s_pe, kv_smem, pe_smem, full, empty,
              R: gl.constexpr, DR: gl.constexpr, PDL: gl.constexpr):
    """The gathering partition: tile `it` into stage it % STAGES as soon as the consumers released that stage.
    Each thread's cp.async copies arrive on full[stage] when they land (the barrier counts all its threads)."""
    if PDL:  # the row numbers come from the kernel before
        _wait_for_previous_kernel()
    # 16 bytes per thread per row chunk, one row per warp at a time.
    kv_ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
    pe_ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // DR, DR // 8], [PRODUCER_WARPS, 1], [1, 0])
    for it in range(gl.cdiv(end - start, BLOCK_N)):
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # parity 1 of a fresh barrier passes at once
        n0 = start + it * BLOCK_N
        _gather_to_smem(rows, n0, end, kv_ptr, zero_ptr, s_kv, kv_smem.index(s), R, BLOCK_N, kv_ld)
        _gather_to_smem(rows, n0, end, pe_ptr, zero_ptr, s_pe, pe_smem.index(s), DR, BLOCK_N, pe_ld)
        cp.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _consumer(rows, start, end, qk_scale, q_base, qpe_base, s_qh, s_ph, h0, H, q_smem, qpe_smem, kv_smem, pe_smem,
              p_smem, full, empty, R: gl.constexpr, DR: gl.constexpr, PDL: gl.constexpr):
    """The two warp groups that compute: load the query, then per tile wait for it, score, softmax, values,
    and release the stage. Returns (acc [BLOCK_H, R], m, l) of this program's positions."""
    # Scores: the warp groups split the BLOCK_N columns; values: they split the R columns.
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, R // 2, 16])
    _query_to_smem(q_base, s_qh, h0, H, R, gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]), q_smem)
    _query_to_smem(qpe_base, s_ph, h0, H, DR, gl.BlockedLayout([1, 8], [32 * 8 // DR, DR // 8], [8, 1], [1, 0]),
                   qpe_smem)
    fence_async_shared()  # for the wgmma; the loop's first barrier makes both halves visible
    if PDL:  # the query was written before the row-number pass, the row numbers by it
        _wait_for_previous_kernel()
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_l)
    acc = gl.zeros([BLOCK_H, R], gl.float32, layout=o_l)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_l)
    cols_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    for it in range(gl.cdiv(end - start, BLOCK_N)):
        s = it % STAGES
        n0 = start + it * BLOCK_N  # (loaded before the waits, its latency hides behind them)
        valid = gl.load(rows + n0 + cols_n, mask=n0 + cols_n < end, other=-1) >= 0
        gl.thread_barrier()  # both groups' value wgmma of the last tile are done with p_smem
        mbarrier.wait(full.index(s), (it // STAGES) & 1)
        fence_async_shared()  # the producer's cp.async writes (generic proxy), read next by wgmma (async proxy)
        kv_t = kv_smem.index(s)
        sc = _scores(q_smem, qpe_smem, kv_t, pe_smem.index(s), s_zero)
        alpha, m_i, l_acc = _softmax_to_smem(sc, valid, m_i, l_acc, qk_scale, p_smem)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        acc = warpgroup_mma_wait(0, deps=(warpgroup_mma(p_smem, kv_t, acc, is_async=True),))
        mbarrier.arrive(empty.index(s))  # one arrival (after a barrier of both groups): the stage is free
    return acc, m_i, gl.sum(l_acc, axis=1)


@gluon.jit
def _latent_attn_fwd_sm90(
    q_ptr, qpe_ptr, kv_ptr, pe_ptr, zero_ptr, rows_ptr, o_ptr, m_ptr, l_ptr,
    T, H, K, keys_per_split, qk_scale,
    s_qb, s_qt, s_qh, s_pb, s_pt, s_ph, s_kv, s_pe,
    s_ob, s_ot, s_os, s_oh, s_mbt, s_ms,
    R: gl.constexpr, DR: gl.constexpr, NUM_SPLITS: gl.constexpr, PDL: gl.constexpr,
):
    dt: gl.constexpr = kv_ptr.dtype.element_ty
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, R // 2, 16])
    bt = gl.program_id(0).to(gl.int64)
    b, t, h0, split = bt // T, bt % T, gl.program_id(1) * BLOCK_H, gl.program_id(2)
    start = split * keys_per_split
    end = gl.minimum(start + keys_per_split, K)
    rows = rows_ptr + bt * K
    q_smem = gl.allocate_shared_memory(dt, [BLOCK_H, R], _nvmma([BLOCK_H, R], dt))
    qpe_smem = gl.allocate_shared_memory(dt, [BLOCK_H, DR], _nvmma([BLOCK_H, DR], dt))
    kv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, R], _nvmma([BLOCK_N, R], dt))
    pe_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], _nvmma([BLOCK_N, DR], dt))
    p_smem = gl.allocate_shared_memory(dt, [BLOCK_H, BLOCK_N], _nvmma([BLOCK_H, BLOCK_N], dt))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty.index(i), count=1)
    acc, m_i, l_i = gl.warp_specialize([
        (_consumer, (rows, start, end, qk_scale, q_ptr + b * s_qb + t * s_qt, qpe_ptr + b * s_pb + t * s_pt, s_qh,
                     s_ph, h0, H, q_smem, qpe_smem, kv_smem, pe_smem, p_smem, full, empty, R, DR, PDL)),
        (_producer, (rows, start, end, kv_ptr, pe_ptr, zero_ptr, s_kv, s_pe, kv_smem, pe_smem, full, empty, R, DR,
                     PDL)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
    _store_result(acc, m_i, l_i, o_ptr, m_ptr, l_ptr, b * s_ob + t * s_ot + split * s_os,
                  bt * s_mbt + split * s_ms, h0, H, s_oh, R, NUM_SPLITS, o_l, s_l)


def launch(grid, q_latent, q_pe, kv_plane, pe_plane, zero, rows, out, m, lse, sizes, out_strides, ml_strides,
           R: int, DR: int, splits: int, pdl: bool = False):
    """Launch the kernel with the Triton kernel's argument order (see _latent_attention); ``pdl``: as a
    programmatic dependent of the row-number pass."""
    _latent_attn_fwd_sm90[grid](q_latent, q_pe, kv_plane, pe_plane, zero, rows, out, m, lse, *sizes, *out_strides,
                                *ml_strides, R=R, DR=DR, NUM_SPLITS=splits, PDL=pdl, num_warps=8,
                                **({"launch_pdl": True} if pdl else {}))
