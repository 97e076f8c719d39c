"""The union-form prefill attention on Hopper (sm_90) in Gluon: ``prefill_attn_triton._union_attn_fwd``'s math,
with the gathers in a warp group of their own and the query in registers.

Same inputs, grid and math as the Triton kernel (read it first): one program per (head, 128-query tile,
sequence), FlashAttention over the tile's sorted union of selected positions, the gathered k, k_pe and v
rows of one head, a bit per (query, union slot) saying whether the query selected it (the chunk-major
mask of ``prefill_union_triton._mask_row``), online softmax in fp32, base 2. Only the work inside a program
differs: three warp groups with separate roles, synchronised through mbarriers in shared memory.

    producer (4 warps)   cp.async gathers of chunk c's k, k_pe and v rows (64 union slots) into stage
                         c % 4 of a ring, once both compute groups released that stage
    compute group 0      queries 0..63 of the tile: scores, softmax and p @ v on every chunk
    compute group 1      queries 64..127, the same

Why each choice:
- The query lives in registers, as the A operand of the score wgmma (48 registers per thread). From
  shared memory, every m64n64 score wgmma re-reads its 64 x 16 query slice beside the 64 x 16 key slice:
  96 KB of the 168 KB a chunk moves through shared memory (counted from the tile shapes) would re-read the
  query (the Triton kernel reads it from shared memory, with m64n32 score wgmma: worse).
- Scores stay unscaled until the exponent: the mask selects on the raw score, the row maximum is taken
  on raw scores (qk_scale > 0 commutes with max; the dispatcher sends other scales to the Triton kernel)
  and exp2(s * scale - m * scale) is one FFMA. Slots past the union's count need no test of their own:
  their mask words are zero.
- The mask test is written in PTX (and, setp, selp: ptxas makes it one LOP3 with a predicate and one
  FSEL per score). Written as a comparison, LLVM packs the 16 predicates of a row pair into an integer
  and unpacks them again, five instructions per score.
- Slots past count gather the union's last position instead of a zero row (their mask bits are 0, so
  they score -inf and p = 0), so the producer computes no select per row; k and v rows of a position are
  DN apart and share one address (the v copy adds an immediate offset). A position padding a chunk is one
  some query of the tile selected, so it reads no row the tile would not read anyway (NaN there: see the
  Triton kernel).
- Four stages (160 KB of shared memory at the K3 widths), 232 registers for each compute group and 40 for
  the producer (a few spills in the producer; with 224 the compute groups spill): the fastest counts.
- Within a group, FlashAttention-3's overlap: chunk c + 1's score wgmma run while the group's threads do
  chunk c's softmax (``_chunk_pairs``).

What binds it: the dots and the softmax of each chunk, at about 60 % of the bf16 tensor-core peak (the Triton
kernel: about half), not memory traffic. Outputs are within 5e-4 of the output scale of the Triton kernel's
(sums in another order, chunks of 64 against 32) and bitwise equal run to run.

Used by the prefill op's sm_90 form (sm90_gluon.py, the backends "gluon" and "auto") through
``prefill_attn_triton.attend`` when ``gluon_fits`` says so (sm_90, bf16/fp16, dn = dv in {64, 128}, dr in
{32, 64}, qk_scale > 0, int32 offsets); everything else, and every CPU run, takes the Triton kernel. Gluon has
no interpreter: this kernel is tested on the GPU only (tests/ops/test_mla_prefill_gluon.py, through the device
tool), against the reference and the Triton kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .._pdl import capability
from .latent_gluon import SMEM_LIMIT, nvmma

BLOCK_M = gl.constexpr(128)  # queries per program: the Triton kernel's tile, whose unions and masks this reads
HALF_M = gl.constexpr(64)  # queries per compute group: one wgmma M
BLOCK_N = gl.constexpr(64)  # union slots per chunk: the score wgmma's N, two 32-slot mask words
STAGES = gl.constexpr(4)  # chunks in flight, 40 KB each at the K3 widths (module docstring)
PRODUCER_WARPS = gl.constexpr(4)  # the gathering partition: one warp group (setmaxnreg works per warp group)
PRODUCER_REGS = gl.constexpr(40)
COMPUTE_REGS = gl.constexpr(232)  # compute group 1's; group 0, the default partition, gets what is left: 232
# -inf where the query's bit for the slot is clear, else the score: one LOP3 (with a predicate) and one FSEL.
_SELECT_PTX = gl.constexpr("{ .reg .pred p; .reg .b32 t; and.b32 t, $1, $2; setp.ne.u32 p, t, 0; "
                           "selp.f32 $0, $3, 0fFF800000, p; }")


def gluon_fits(q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, dn: int, qk_scale: float) -> bool:
    """Whether this kernel handles the call (else the Triton kernel does): sm_90, bf16/fp16, the widths its
    copy layouts, wgmma shapes and registers take, a positive scale, int32 offsets (the output [B, T, H, dv]
    has fewer elements than q [B, T, H, dn + dr] when dv = dn)."""
    if kv.device.type != "cuda" or capability(kv.device.index) != (9, 0):
        return False
    if kv.dtype not in (torch.bfloat16, torch.float16) or k_pe.dtype != kv.dtype:
        return False
    dr, dv = k_pe.shape[-1], kv.shape[-1] - dn
    # dn = dv: a position's k and v rows share one address. The query's registers grow with dn + dr and
    # the accumulator's with dv; 128 + 64 and 128 are what 232 registers hold.
    widths_ok = dn == dv and dn in (64, 128) and dr in (32, 64)
    smem = 2 * int(STAGES) * int(BLOCK_N) * (dn + dr + dv) + 16 * int(STAGES) + 1024
    return (widths_ok and qk_scale > 0 and smem <= SMEM_LIMIT
            and max(q.numel(), kv.numel(), k_pe.numel()) < 2**31)


@gluon.jit
def _positions(union, n0, count, layout: gl.constexpr):
    """Union positions of slots n0..n0+BLOCK_N in the row slice of ``layout``; slots past count repeat the
    last position (count >= 1 whenever the producer runs)."""
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    return gl.load(union + gl.minimum(n, count - 1))


@gluon.jit
def _producer(union, count, k_row, pe_row, s_ks, s_ps, k_smem, v_smem, pe_smem, full, empty,
              DN: gl.constexpr, DR: gl.constexpr):
    """Chunk c into stage c % STAGES once both compute groups released it; each thread's copies arrive on
    full[stage] when they land. The next chunk's positions are loaded before the wait."""
    k_ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // DN, DN // 8], [PRODUCER_WARPS, 1], [1, 0])
    pe_ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // DR, DR // 8], [PRODUCER_WARPS, 1], [1, 0])
    k_cols = gl.arange(0, DN, layout=gl.SliceLayout(0, k_ld))
    pe_cols = gl.arange(0, DR, layout=gl.SliceLayout(0, pe_ld))
    p_k, p_pe = _positions(union, 0, count, k_ld), _positions(union, 0, count, pe_ld)
    n_pairs = gl.cdiv(gl.cdiv(count, BLOCK_N), 2)
    for c in range(gl.where(n_pairs > 0, 2 * n_pairs + 1, 0)):  # padded as the compute groups read them
        s = c % STAGES
        next_k = _positions(union, (c + 1) * BLOCK_N, count, k_ld)
        next_pe = _positions(union, (c + 1) * BLOCK_N, count, pe_ld)
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)  # parity 1 of a fresh barrier passes at once
        k_ptr = (k_row + p_k * s_ks)[:, None] + k_cols[None, :]
        cp.async_copy_global_to_shared(k_smem.index(s), k_ptr)
        cp.async_copy_global_to_shared(v_smem.index(s), k_ptr + DN)  # v's row is k's, DN further
        cp.async_copy_global_to_shared(pe_smem.index(s), (pe_row + p_pe * s_ps)[:, None] + pe_cols[None, :])
        cp.mbarrier_arrive(full.index(s), increment_count=False)
        p_k, p_pe = next_k, next_pe


@gluon.jit
def _query_regs(ptr, rows, row_ok, s_qt, W: gl.constexpr, dt: gl.constexpr, op_l: gl.constexpr):
    """q[rows, 0:W] (rows past T: 0) in dtype dt (the Triton kernel rounds q the same way), in the register
    layout of the score wgmma's A operand."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // W, W // 8], [4, 1], [1, 0])
    r = gl.convert_layout(rows, gl.SliceLayout(1, layout))
    ok = gl.convert_layout(row_ok, gl.SliceLayout(1, layout))
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    x = gl.load(ptr + r[:, None] * s_qt + cols[None, :], mask=ok[:, None], other=0.0)
    return gl.convert_layout(x.to(dt), op_l)


@gluon.jit
def _scores(c, dead, q, q_pe, k_smem, pe_smem, full):
    """Issue chunk c's score wgmma (q_pe . k_pe + q_nope . k, unscaled) once its stage has landed; returns
    at once. ``dead``: a consumed score tile whose registers the new one takes (use_acc=False ignores its
    values; a fresh zero tile would be written by plain moves while a wgmma is in flight, and ptxas then
    serialises every wgmma of the kernel)."""
    s = c % STAGES
    mbarrier.wait(full.index(s), (c // STAGES) & 1)
    fence_async_shared()  # the producer's cp.async writes (generic proxy), read next by wgmma (async proxy)
    sc = warpgroup_mma(q_pe, pe_smem.index(s).permute((1, 0)), dead, use_acc=False, is_async=True)
    return warpgroup_mma(q, k_smem.index(s).permute((1, 0)), sc, is_async=True)


@gluon.jit
def _mask_words(c, mask_rows, words):
    """The mask words of chunk c's slots 64c.. and 64c+32.. for this group's queries (0 past the tile's
    mask, which is chunk-major: [words, BLOCK_M])."""
    return (gl.load(mask_rows + (2 * c) * BLOCK_M, mask=2 * c < words, other=0),
            gl.load(mask_rows + (2 * c + 1) * BLOCK_M, mask=2 * c + 1 < words, other=0))


@gluon.jit
def _softmax_values(c, sc, w0, w1, m_i, l_i, acc, qk_scale, v_smem, o_l: gl.constexpr):
    """Chunk c's raw scores (complete) -> -inf where the query did not select the slot, the online-softmax
    step (m_i on raw scores), acc * alpha, and the value wgmma acc += p @ v issued (not waited for)."""
    s_l: gl.constexpr = sc.type.layout
    j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))[None, :]
    bit = gl.full([1, BLOCK_N], 1, gl.int32, s_l) << (j % 32)
    word = gl.where(j < 32, w0[:, None], w1[:, None])
    sc = gl.inline_asm_elementwise(_SELECT_PTX, "=r,r,r,r", [word, bit, sc], dtype=gl.float32, is_pure=True,
                                   pack=1)
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale  # a row with nothing selected yet: p = 0
    alpha = gl.exp2(m_i * qk_scale - m_safe)
    p32 = gl.exp2(sc * qk_scale - m_safe[:, None])
    l_i = l_i * alpha + gl.sum(p32, axis=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    p = gl.convert_layout(p32.to(v_smem.dtype), p_op)
    return m_new, l_i, warpgroup_mma(p, v_smem.index(c % STAGES), acc, is_async=True)


@gluon.jit
def _chunk_pairs(n_pairs, q, q_pe, mask_rows, words, m_i, l_i, acc, qk_scale, k_smem, v_smem, pe_smem, full,
                 empty, s_l: gl.constexpr, o_l: gl.constexpr):
    """Every chunk, two per step, with FlashAttention-3's overlap inside a group: chunk c + 1's score wgmma
    runs on the tensor cores while this group's threads do chunk c's softmax, and chunk c's value wgmma with
    chunk c + 2's scores while they do chunk c + 1's. wgmma groups complete in order, so "all but the newest
    n" names which are done. A step ends with nothing in flight: a pending tile carried round the loop is
    copied by plain moves, and ptxas then serialises every wgmma of the kernel. The producer pads the chunks
    to an even count plus one (their mask words are 0: -inf, p = 0)."""
    sc_a = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_l)
    sc_a = warpgroup_mma_wait(0, deps=(_scores(0, sc_a, q, q_pe, k_smem, pe_smem, full),))
    sc_b = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_l)
    wa0, wa1 = _mask_words(0, mask_rows, words)
    wb0, wb1 = _mask_words(1, mask_rows, words)
    for k in range(n_pairs):
        c = 2 * k
        na0, na1 = _mask_words(c + 2, mask_rows, words)  # a step ahead: their latency hides behind this one
        nb0, nb1 = _mask_words(c + 3, mask_rows, words)
        sc_b = _scores(c + 1, sc_b, q, q_pe, k_smem, pe_smem, full)
        m_i, l_i, acc = _softmax_values(c, sc_a, wa0, wa1, m_i, l_i, acc, qk_scale, v_smem, o_l)
        sc_b = warpgroup_mma_wait(1, deps=(sc_b,))  # chunk c + 1's scores; chunk c's values may run on
        sc_a = _scores(c + 2, sc_a, q, q_pe, k_smem, pe_smem, full)
        acc = warpgroup_mma_wait(2, deps=(acc,))  # chunk c's values (chunk c + 2's two score groups may run)
        mbarrier.arrive(empty.index(c % STAGES))
        m_i, l_i, acc = _softmax_values(c + 1, sc_b, wb0, wb1, m_i, l_i, acc, qk_scale, v_smem, o_l)
        sc_a, acc = warpgroup_mma_wait(0, deps=(sc_a, acc))
        mbarrier.arrive(empty.index((c + 1) % STAGES))
        wa0, wa1, wb0, wb1 = na0, na1, nb0, nb1
    return l_i, acc


@gluon.jit
def _compute_group(ME: gl.constexpr, q_base, o_base, mask_rows0, words, count, T, tile, qk_scale, s_qt, s_ot,
                   k_smem, v_smem, pe_smem, full, empty, DN: gl.constexpr, DR: gl.constexpr, DV: gl.constexpr):
    """Queries tile * 128 + ME * 64 .. + 63 over every chunk of the union."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    q_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, s_l)
    rows = tile * BLOCK_M + ME * HALF_M + gl.arange(0, HALF_M, layout=row_l)
    q = _query_regs(q_base, rows, rows < T, s_qt, DN, k_smem.dtype, q_l)
    q_pe = _query_regs(q_base + DN, rows, rows < T, s_qt, DR, k_smem.dtype, q_l)
    mask_rows = mask_rows0 + ME * HALF_M + gl.arange(0, HALF_M, layout=row_l)
    l_i = gl.zeros([HALF_M], gl.float32, layout=row_l)
    acc = gl.zeros([HALF_M, DV], gl.float32, layout=o_l)
    n_pairs = gl.cdiv(gl.cdiv(count, BLOCK_N), 2)
    if n_pairs > 0:
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_l)
        l_i, acc = _chunk_pairs(n_pairs, q, q_pe, mask_rows, words, m_i, l_i, acc, qk_scale, k_smem, v_smem,
                                pe_smem, full, empty, s_l, o_l)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
    o = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]  # a query with nothing selected: acc = 0, stays 0
    r = gl.convert_layout(rows, gl.SliceLayout(1, o_l))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_l))
    gl.store(o_base + r[:, None] * s_ot + cols[None, :], o, mask=(r < T)[:, None])


@gluon.jit(do_not_specialize=["T", "L", "n_tiles"])  # one compiled variant for every prompt length
def _union_attn_fwd_sm90(q_ptr, kv_ptr, pe_ptr, mask_ptr, mask_off_ptr, union_ptr, count_ptr, o_ptr, T, L, n_tiles,
                         qk_scale, s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_pb, s_ps, s_ob, s_ot, s_oh,
                         DN: gl.constexpr, DR: gl.constexpr, DV: gl.constexpr):
    dt: gl.constexpr = kv_ptr.dtype.element_ty
    h = gl.program_id(0)  # heads vary fastest: the H programs of a tile share its list and mask in L2
    tile = n_tiles - 1 - gl.program_id(1)  # the longest unions (the last tiles) start first
    b = gl.program_id(2)
    bi = b * n_tiles + tile
    count = gl.load(count_ptr + bi)
    words = (count + 31) // 32  # mask words per query: one per 32 union slots
    mask_rows0 = mask_ptr + gl.load(mask_off_ptr + bi)
    q_base, o_base = q_ptr + b * s_qb + h * s_qh, o_ptr + b * s_ob + h * s_oh
    k_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DN], nvmma([BLOCK_N, DN], dt))
    v_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DV], nvmma([BLOCK_N, DV], dt))
    pe_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], nvmma([BLOCK_N, DR], dt))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())  # stage landed
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())  # stage read by both
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([
        (_compute_group, (0, q_base, o_base, mask_rows0, words, count, T, tile, qk_scale, s_qt, s_ot, k_smem, v_smem,
                          pe_smem, full, empty, DN, DR, DV)),
        (_compute_group, (1, q_base, o_base, mask_rows0, words, count, T, tile, qk_scale, s_qt, s_ot, k_smem, v_smem,
                          pe_smem, full, empty, DN, DR, DV)),
        (_producer, (union_ptr + bi * L, count, kv_ptr + b * s_kb + h * s_kh, pe_ptr + b * s_pb, s_ks, s_ps, k_smem,
                     v_smem, pe_smem, full, empty, DN, DR)),
    ], [4, PRODUCER_WARPS], [COMPUTE_REGS, PRODUCER_REGS])


def attend(q, kv, k_pe, union, count, mask, mask_off, out, dn: int, qk_scale: float) -> None:
    """``prefill_attn_triton.attend`` on this kernel: q [B, T, H, dn+dr], kv [B, S, H, dn+dv], k_pe [B, S, dr],
    the tiles' unions, counts and chunk-major masks, qk_scale = scale * log2(e) -> out [B, T, H, dv] fp32."""
    B, T, H, dq = q.shape
    dr, dv, n_tiles = dq - dn, out.shape[-1], union.shape[1]
    _union_attn_fwd_sm90[(H, n_tiles, B)](
        q, kv, k_pe, mask, mask_off, union, count, out, T, union.shape[-1], n_tiles, qk_scale,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), k_pe.stride(0),
        k_pe.stride(1), out.stride(0), out.stride(1), out.stride(2), DN=dn, DR=dr, DV=dv, num_warps=4)
