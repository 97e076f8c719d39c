"""Sparse MLA attention on Hopper (sm_90) in Gluon: the Triton kernel's math, with each warp group's role explicit.

Same math, grid, split scheme and row-number pass as ``latent_triton._latent_attn_fwd`` (read that first): one
program per (query, block of 64 heads, split of the selected positions), absorbed form, online softmax in fp32,
invalid positions read a zero row and score -inf. Only the work inside a program differs: three warp groups with
separate roles, synchronised through mbarriers in shared memory.

    producer (4 warps)   cp.async gathers of tile t's rows into stage t % 2 of a two-stage ring of
                         NVMMA-swizzled [64, r + dr] tiles, once both compute groups released the stage
    compute group 0      scores the even tiles, owns value columns [0, r/2) of every tile
    compute group 1      scores the odd tiles, owns value columns [r/2, r)

A compute group takes the tiles in order. On its own tile it computes the whole [64, 64] score tile
(m64n64 wgmma), the online-softmax step, and hands p (bf16), the new row max and the rescale factor to the
other group through shared memory (``ready``), then adds p @ kv[:, its half] (p from registers). On the
other group's tile it reads those three, rescales its accumulator and adds p @ kv[:, its half]. Each
accumulator is [64, r/2] fp32 (128 registers per thread: a [64, 512] one fits no warp group), and both see
every rescale in tile order; the row sums each group gathered over its own tiles are added at the end.

Why this shape:
- Triton's compiler gives a dot whose result feeds another dot all its warps along M (``warpsPerTileV3``'s
  chained-dot rule): in the Triton kernel both warp groups compute the whole score tile, with half-width
  m64n32 instructions. Here each score tile is computed once, by one group.
- A copy instruction stalls its warp until the memory pipeline takes it, so compute warps that issue the
  cp.async copies too run loads and dots one after the other inside an SM. A producer warp group of its own
  issues them while the compute groups score and accumulate.
- Score tiles split by columns between the groups are bound by shared-memory reads: each group's m64n32
  wgmma re-reads the whole query block for half the columns (216 KB per 64 positions). A group scoring a
  whole tile with m64n64 reads 144 KB, and while one group is in its softmax the other's wgmma run.
- The producer loads the next tile's row numbers before it waits for a stage, so their L2 latency does not
  come before every gather.
Shared memory: the query (72 KB), two [64, 576] bf16 stages (2 x 72 KB), p (8 KB), the row statistics and
the barriers: 225 KB of the 227 KB a program may use, so there is no third stage.

What binds it: the chain gather -> score wgmma -> softmax -> value wgmma per tile, at one program per SM. At
96 heads two 64-head blocks gather the same rows and the second is half padding: the tensor-core work is
128/96 of the useful work.

Used by the ops' sm_90 forms (sm90_gluon.py, the backends "gluon" and "auto") through
``latent_triton._latent_attention`` when ``gluon_fits`` says so (sm_90, bf16/fp16 planes, r 256 or 512, dr a
power of two in 16..256 with r + dr <= 576, more than 16 heads, planes under 2^31 elements); everything else,
and every CPU run, takes the Triton kernel. Gluon has no interpreter: this
kernel is tested on the GPU only (tests/ops/test_mla_gluon.py, through the device tool), against the same
reference and the Triton kernel, and bitwise run to run.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .._pdl import capability, launch_options

# Compile-time constants of the kernels (the host reads them through int()).
BLOCK_H = gl.constexpr(64)  # one wgmma M: each compute group holds all 64 heads' rows
BLOCK_N = gl.constexpr(64)  # positions per tile
STAGES = gl.constexpr(2)  # gathered tiles in flight: all that fits beside the query (module docstring)
PRODUCER_WARPS = gl.constexpr(4)  # the gathering partition: one warp group (setmaxnreg works per warp group)
PRODUCER_REGS = gl.constexpr(56)  # its registers per thread (at 40 it spills)
COMPUTE_REGS = gl.constexpr(232)  # compute group 1's (group 0, the default partition, gets what is left: 216)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one program may use on sm_90


def gluon_fits(kv_plane: torch.Tensor, pe_plane: torch.Tensor, H: int) -> bool:
    """Whether this kernel handles the call (else the Triton kernel does)."""
    R, DR = kv_plane.shape[-1], pe_plane.shape[-1]
    if kv_plane.device.type != "cuda" or capability(kv_plane.device.index) != (9, 0):
        return False
    if kv_plane.dtype not in (torch.bfloat16, torch.float16) or pe_plane.dtype != kv_plane.dtype:
        return False
    # 16 heads or fewer: the Triton kernel's 16-row tiles are faster. From 17 heads this kernel wins despite
    # padding its 64-row tiles, against the Triton kernel's 32-row tiles (H200 times: docs/benchmarks.md,
    # "Gluon against Triton latent kernel, by head count").
    if H <= 16:
        return False
    # r/2 is each group's value wgmma N (at most 256) and the query loads in 128-column chunks, half per group;
    # the copy layouts assume widths of whole 16-byte vectors.
    widths_ok = R in (256, 512) and DR in (16, 32, 64, 128, 256)
    bh, bn, stages = int(BLOCK_H), int(BLOCK_N), int(STAGES)
    smem = 2 * (bh * (R + DR) + stages * bn * (R + DR) + bh * bn) + 4 * 4 * bh + 8 * (2 * stages + 3)
    smem += 1024  # alignment the compiler adds (328 bytes at r=512, dr=64: 230,784 bytes compiled)
    return widths_ok and smem <= SMEM_LIMIT and max(kv_plane.numel(), pe_plane.numel()) < 2**31


@triton.constexpr_function
def nvmma(shape, dtype):
    """The swizzled shared layout wgmma reads (the widest swizzle the row allows)."""
    return gl.NVMMASharedLayout.get_default_for(shape, dtype)


@gluon.jit
def _wait_for_previous_kernel():
    """griddepcontrol.wait: the kernel this one was launched after (as its programmatic dependent) has completed
    and its writes are visible. Before this call a thread may only read what older kernels wrote."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _opaque_zero():
    """0, unknown to the compiler. A stage index built from it keeps the 36 wgmma descriptors of a tile from
    being hoisted out of the loop: held in registers for the whole loop as 64-bit values, they spill;
    computed per use, they cost a few integer instructions."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _tile_rows(rows_ptr, n0, end, BLOCK: gl.constexpr, layout: gl.constexpr):
    """Row numbers of positions n0..n0+BLOCK (-1 past ``end``), in the row slice of ``layout``."""
    n = n0 + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    return gl.load(rows_ptr + n, mask=n < end, other=-1)


@gluon.jit
def _gather_to_smem(r, plane_ptr, zero_ptr, stride, buf, W: gl.constexpr, layout: gl.constexpr):
    """cp.async the rows r (row numbers, -1: the zero row) of one plane into buf [BLOCK, W]: 16-byte copies
    (int32 offsets: planes under 2^31 elements)."""
    ptr = gl.where(r >= 0, plane_ptr + r * stride, zero_ptr)
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    cp.async_copy_global_to_shared(buf, ptr[:, None] + cols[None, :])


@gluon.jit
def _producer(rows, start, end, n_tiles, kv_ptr, pe_ptr, zero_ptr, s_kv, s_pe, kv_smem, pe_smem, full, empty,
              R: gl.constexpr, DR: gl.constexpr, PDL: gl.constexpr):
    """The gathering partition: tile `it` into stage it % STAGES as soon as both compute groups released that
    stage. Each thread's cp.async copies arrive on full[stage] when they land (the barrier counts all its
    threads). The next tile's row numbers are loaded before the wait, so their latency is not added to it."""
    # 16 bytes per thread per row chunk, one row per warp at a time.
    kv_ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
    pe_ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // DR, DR // 8], [PRODUCER_WARPS, 1], [1, 0])
    if PDL:  # the row numbers come from the kernel before
        _wait_for_previous_kernel()
    r_kv = _tile_rows(rows, start, end, BLOCK_N, kv_ld)
    r_pe = _tile_rows(rows, start, end, BLOCK_N, pe_ld)
    for it in range(n_tiles):
        s = it % STAGES
        n_next = start + (it + 1) * BLOCK_N
        next_kv = _tile_rows(rows, n_next, end, BLOCK_N, kv_ld)
        next_pe = _tile_rows(rows, n_next, end, BLOCK_N, pe_ld)
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # parity 1 of a fresh barrier passes at once
        _gather_to_smem(r_kv, kv_ptr, zero_ptr, s_kv, kv_smem.index(s), R, kv_ld)
        _gather_to_smem(r_pe, pe_ptr, zero_ptr, s_pe, pe_smem.index(s), DR, pe_ld)
        cp.mbarrier_arrive(full.index(s), increment_count=False)
        r_kv, r_pe = next_kv, next_pe


@gluon.jit
def _query_to_smem(q_ptr, hoff, h0, H, W: gl.constexpr, layout: gl.constexpr, q_smem):
    """The [BLOCK_H, W] query block (padded heads: 0) into q_smem, in the planes' dtype (the Triton kernel
    rounds q the same way)."""
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    q = gl.load(q_ptr + heads.to(gl.int64)[:, None] * hoff + cols[None, :], mask=(heads < H)[:, None], other=0.0)
    q_smem.store(q.to(q_smem.dtype))


@gluon.jit
def _load_query(ME: gl.constexpr, q_base, qpe_base, s_qh, s_ph, h0, H, q_smem, qpe_smem, qready,
                R: gl.constexpr, DR: gl.constexpr):
    """Each group loads half of the query's 128-column chunks (the whole [64, 512] block would be 256 values
    per thread), group 1 also q_pe; both wait until both halves are in shared memory."""
    for c in gl.static_range(ME * (R // 256), (ME + 1) * (R // 256)):
        _query_to_smem(q_base + c * 128, s_qh, h0, H, 128, gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]),
                       q_smem.index(0).slice(c * 128, 128, dim=1))
    if ME == 1:
        _query_to_smem(qpe_base, s_ph, h0, H, DR, gl.BlockedLayout([1, 8], [32 * 8 // DR, DR // 8], [4, 1], [1, 0]),
                       qpe_smem.index(0))
    fence_async_shared()  # generic-proxy writes that wgmma (async proxy) reads
    mbarrier.arrive(qready)
    mbarrier.wait(qready, 0)


@gluon.jit
def _own_tile(ME: gl.constexpr, t, k, m_i, l_i, acc, rows, start, end, qk_scale, q_smem, qpe_smem, kv_smem,
              pe_smem, p_smem, stat_smem, full, empty, ready, R: gl.constexpr, s_l: gl.constexpr,
              o_l: gl.constexpr):
    """Tile t, stage ME, scored by this group: the whole [64, 64] score tile, the online-softmax step, p with the
    new row max and the rescale factor handed to the other group through shared memory, then this group's value
    columns. The reference point m_safe = 0 of a row with no valid key keeps 2^-inf = 0."""
    cols_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    n0 = start + t * BLOCK_N
    valid = gl.load(rows + n0 + cols_n, mask=n0 + cols_n < end, other=-1) >= 0  # (its latency hides in the wait)
    mbarrier.wait(full.index(ME), k & 1)
    fence_async_shared()  # the producer's cp.async writes (generic proxy), read next by wgmma (async proxy)
    z = _opaque_zero()
    s = warpgroup_mma(qpe_smem.index(z), pe_smem.index(ME + z).permute((1, 0)),
                      gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_l), use_acc=False, is_async=True)
    s = warpgroup_mma(q_smem.index(z), kv_smem.index(ME + z).permute((1, 0)), s, is_async=True)
    s = gl.where(valid[None, :], warpgroup_mma_wait(0, deps=(s,)) * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p32 = gl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + gl.sum(p32, axis=1)  # the unrounded p, as in the reference's normaliser
    p = p32.to(kv_smem.dtype)
    p_smem.store(p)  # the other group's last read of p_smem (tile t-1) ended before this group's
    stat_smem.slice(0, BLOCK_H).store(m_new)
    stat_smem.slice(BLOCK_H, BLOCK_H).store(alpha)
    fence_async_shared()
    mbarrier.arrive(ready)  # one arrival, after a barrier of this group's warps
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    acc = _add_values(acc, alpha, gl.convert_layout(p, p_op), kv_smem, ME, empty, ME, R, o_l)  # p from registers
    return m_new, l_i, acc


@gluon.jit
def _other_tile(ME: gl.constexpr, t, l_i, acc, kv_smem, p_smem, stat_smem, empty, ready, R: gl.constexpr,
                o_l: gl.constexpr, row_l: gl.constexpr):
    """Tile t, stage 1 - ME, scored by the other group: its row max, rescale factor and p from shared memory,
    then this group's value columns."""
    mbarrier.wait(ready, t & 1)
    fence_async_shared()
    m_i = stat_smem.slice(0, BLOCK_H).load(row_l)
    alpha = stat_smem.slice(BLOCK_H, BLOCK_H).load(row_l)
    acc = _add_values(acc, alpha, p_smem, kv_smem, 1 - ME, empty, ME, R, o_l)
    return m_i, l_i * alpha, acc


@gluon.jit
def _add_values(acc, alpha, p, kv_smem, j, empty, ME: gl.constexpr, R: gl.constexpr, o_l: gl.constexpr):
    """acc * alpha + p @ (stage j's rows, this group's value columns), then this group releases stage j. p: the
    group's own tile's, in registers, or the other group's, in shared memory."""
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    acc = warpgroup_mma(p, kv_smem.index(j + _opaque_zero()).slice(ME * (R // 2), R // 2, dim=1), acc)
    mbarrier.arrive(empty.index(j))
    return acc


@gluon.jit
def _store_half(ME: gl.constexpr, acc, m_i, l_i, l_smem, done, o_ptr, m_ptr, l_ptr, o_base, ml_base, h0, H, s_oh,
                R: gl.constexpr, NUM_SPLITS: gl.constexpr, o_l: gl.constexpr, row_l: gl.constexpr):
    """Each group summed p over the tiles it scored: both row sums are added in a fixed order, then o = acc / l
    (one split) or the split's acc, m and l for _combine_splits, each group its value columns."""
    l_smem.slice(ME * BLOCK_H, BLOCK_H).store(l_i)
    mbarrier.arrive(done)
    mbarrier.wait(done, 0)
    l_i = l_smem.slice(0, BLOCK_H).load(row_l) + l_smem.slice(BLOCK_H, BLOCK_H).load(row_l)
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l))
    cols = ME * (R // 2) + gl.arange(0, R // 2, layout=gl.SliceLayout(0, o_l))
    o_ptrs = o_ptr + o_base + heads.to(gl.int64)[:, None] * s_oh + cols[None, :]
    if NUM_SPLITS == 1:  # a row with no valid position has l = 0, acc = 0: divide by 1, stay zero
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
        o = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
        gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=(heads < H)[:, None])
    else:
        gl.store(o_ptrs, acc, mask=(heads < H)[:, None])
        if ME == 0:
            hm = h0 + gl.arange(0, BLOCK_H, layout=row_l)
            gl.store(m_ptr + ml_base + hm, m_i, mask=hm < H)
            gl.store(l_ptr + ml_base + hm, l_i, mask=hm < H)


@gluon.jit
def _compute_group(ME: gl.constexpr, rows, start, end, n_pairs, qk_scale, q_base, qpe_base, s_qh, s_ph, h0, H,
                   q_smem, qpe_smem, kv_smem, pe_smem, p_smem, stat_smem, l_smem, full, empty, ready, qready, done,
                   o_ptr, m_ptr, l_ptr, o_base, ml_base, s_oh, R: gl.constexpr, DR: gl.constexpr,
                   NUM_SPLITS: gl.constexpr, PDL: gl.constexpr):
    """Compute group ME (0 or 1): scores the tiles t with t % 2 == ME, owns value columns [ME * R/2, (ME + 1) * R/2)
    of every tile, and takes the tiles in order, so its accumulator sees every rescale in order."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R // 2, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, s_l)
    _load_query(ME, q_base, qpe_base, s_qh, s_ph, h0, H, q_smem, qpe_smem, qready, R, DR)
    if PDL:  # the query was written before the row-number pass, the row numbers by it
        _wait_for_previous_kernel()
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_l)
    acc = gl.zeros([BLOCK_H, R // 2], gl.float32, layout=o_l)
    for k in range(n_pairs):  # tiles 2k (scored by group 0) and 2k + 1 (by group 1)
        if ME == 0:
            m_i, l_i, acc = _own_tile(ME, 2 * k, k, m_i, l_i, acc, rows, start, end, qk_scale, q_smem, qpe_smem,
                                      kv_smem, pe_smem, p_smem, stat_smem, full, empty, ready, R, s_l, o_l)
            m_i, l_i, acc = _other_tile(ME, 2 * k + 1, l_i, acc, kv_smem, p_smem, stat_smem, empty, ready, R,
                                        o_l, row_l)
        else:
            m_i, l_i, acc = _other_tile(ME, 2 * k, l_i, acc, kv_smem, p_smem, stat_smem, empty, ready, R,
                                        o_l, row_l)
            m_i, l_i, acc = _own_tile(ME, 2 * k + 1, k, m_i, l_i, acc, rows, start, end, qk_scale, q_smem, qpe_smem,
                                      kv_smem, pe_smem, p_smem, stat_smem, full, empty, ready, R, s_l, o_l)
    _store_half(ME, acc, m_i, l_i, l_smem, done, o_ptr, m_ptr, l_ptr, o_base, ml_base, h0, H, s_oh, R, NUM_SPLITS,
                o_l, row_l)


@gluon.jit
def _latent_attn_fwd_sm90(
    q_ptr, qpe_ptr, kv_ptr, pe_ptr, zero_ptr, rows_ptr, o_ptr, m_ptr, l_ptr,
    T, H, K, keys_per_split, qk_scale,
    s_qb, s_qt, s_qh, s_pb, s_pt, s_ph, s_kv, s_pe,
    s_ob, s_ot, s_os, s_oh, s_mbt, s_ms,
    R: gl.constexpr, DR: gl.constexpr, NUM_SPLITS: gl.constexpr, PDL: gl.constexpr,
):
    dt: gl.constexpr = kv_ptr.dtype.element_ty
    bt = gl.program_id(0).to(gl.int64)
    b, t, h0, split = bt // T, bt % T, gl.program_id(1) * BLOCK_H, gl.program_id(2)
    start = split * keys_per_split
    end = gl.minimum(start + keys_per_split, K)
    n_pairs = gl.cdiv(gl.cdiv(end - start, BLOCK_N), 2)  # an odd tile count ends with a tile of no valid position
    rows = rows_ptr + bt * K
    q_smem = gl.allocate_shared_memory(dt, [1, BLOCK_H, R], nvmma([BLOCK_H, R], dt))  # (indexed by _opaque_zero)
    qpe_smem = gl.allocate_shared_memory(dt, [1, BLOCK_H, DR], nvmma([BLOCK_H, DR], dt))
    kv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, R], nvmma([BLOCK_N, R], dt))
    pe_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], nvmma([BLOCK_N, DR], dt))
    p_smem = gl.allocate_shared_memory(dt, [BLOCK_H, BLOCK_N], nvmma([BLOCK_H, BLOCK_N], dt))
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    stat_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec)  # the last scored tile's max, rescale
    l_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec)  # the two groups' row sums
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())  # stage landed
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())  # stage read by both
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # p, max, rescale handed over
    qready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # the query is in place
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # both row sums are in place
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(ready, count=1)
    mbarrier.init(qready, count=2)
    mbarrier.init(done, count=2)
    gl.warp_specialize([
        (_compute_group, (0, rows, start, end, n_pairs, qk_scale, q_ptr + b * s_qb + t * s_qt,
                          qpe_ptr + b * s_pb + t * s_pt, s_qh, s_ph, h0, H, q_smem, qpe_smem, kv_smem, pe_smem, p_smem,
                          stat_smem, l_smem, full, empty, ready, qready, done, o_ptr, m_ptr, l_ptr,
                          b * s_ob + t * s_ot + split * s_os, bt * s_mbt + split * s_ms, s_oh, R, DR, NUM_SPLITS,
                          PDL)),
        (_compute_group, (1, rows, start, end, n_pairs, qk_scale, q_ptr + b * s_qb + t * s_qt,
                          qpe_ptr + b * s_pb + t * s_pt, s_qh, s_ph, h0, H, q_smem, qpe_smem, kv_smem, pe_smem, p_smem,
                          stat_smem, l_smem, full, empty, ready, qready, done, o_ptr, m_ptr, l_ptr,
                          b * s_ob + t * s_ot + split * s_os, bt * s_mbt + split * s_ms, s_oh, R, DR, NUM_SPLITS,
                          PDL)),
        (_producer, (rows, start, end, 2 * n_pairs, kv_ptr, pe_ptr, zero_ptr, s_kv, s_pe, kv_smem, pe_smem, full,
                     empty, R, DR, PDL)),
    ], [4, PRODUCER_WARPS], [COMPUTE_REGS, PRODUCER_REGS])


def launch(grid, q_latent, q_pe, kv_plane, pe_plane, zero, rows, out, m, lse, sizes, out_strides, ml_strides,
           R: int, DR: int, splits: int, pdl: bool = False):
    """Launch the kernel with the Triton kernel's argument order (see _latent_attention); ``pdl``: as a
    programmatic dependent of the row-number pass. 4 warps: the default partition is compute group 0."""
    _latent_attn_fwd_sm90[grid](q_latent, q_pe, kv_plane, pe_plane, zero, rows, out, m, lse, *sizes, *out_strides,
                                *ml_strides, R=R, DR=DR, NUM_SPLITS=splits, PDL=pdl, num_warps=4,
                                **launch_options(pdl))
