"""Triton kernel of the DSA lightning indexer's scores over the paged key plane (docs/design.md §2,
§12): ``paged_index_scores`` and ``index_scores`` (dense keys as one block per sequence). Same
signatures and results as ``paged_index_scores_ref`` and ``index_scores_ref`` in
``minidsa/ops/indexer/reference.py``: [B, T, S] fp32 scores.

**Scores.** ``I[b,t,s] = sum_h w[b,t,h] * ReLU(scale * q[b,t,h] . k[s])`` is one fused kernel: the
per-head logits, the ReLU and the head-weighted sum all happen on a tile in registers, so the
[B, T, H, S] logits never reach memory; only the [B, T, S] fp32 scores are written.

- *Grid* ``(batch row, query tile, key chunk)``. A program owns ``BLOCK_T`` queries of one sequence and
  a contiguous chunk of that sequence's logical key positions, walked ``BLOCK_N`` keys at a time. Each
  key tile is read from HBM once per program and used by every query and head of the program; the
  chunk count is chosen so that a decode step (one query per row) still has several programs per SM.
- *Heads share each key tile.* One key per token serves all indexer heads, so each program's
  queries and heads are flattened into one operand: column ``c = t_local * H_PAD + h``, and the dot is
  ``keys [BLOCK_N, D] x q^T [D, BLOCK_T*H_PAD]``. In a decode step (T = 1) the H heads of the single
  query are the only query vectors there are, so they, not queries, fill the matrix dimension. The
  keys are the dot's M and the heads its N (not "heads in M"), because M = 64/128 keys is what the
  Hopper tensor-core instruction tiles by, and the head sum then reduces along N, mostly inside each
  thread's accumulator fragment, instead of across warps. ``tl.dot`` needs M, N, K >= 16: H is padded to a
  power of two (at least 16 when the tile holds a single query) and D to a power of two (at least
  16); the padding is masked loads that read nothing and hold zero. Each column's logits go through
  ReLU, times its head weight, and the columns of one query are summed with a reshape
  ``[BLOCK_N, BLOCK_T, H_PAD]`` and a reduction, still in registers. Padding columns are zeroed by a
  select (not by their zero weight), so even a non-finite key cannot turn them into NaN.
- *Paging.* Key position ``s`` lives at row ``s % bs`` of physical block ``block_table[b, s // bs]``.
  Every key of a tile computes its own block index, so the table may be in any order and the tile
  need not align with blocks. A key is loaded only where ``s < context_lens[b]`` and its table entry
  is ``>= 0``: the block-table load itself is masked by the context length, and a -1 entry masks the
  key load, so no memory outside the sequence's own blocks is ever touched; a position without a
  block scores -inf like one past the context, so top-k can never select it (as in the reference).
- *Context length and causal bound.* Positions ``s >= context_lens[b]`` get -inf, and so, when ``q_pos``
  is given, do positions after the query's own. Key tiles wholly past the context or after every query
  of the program's tile are not computed at all: a second loop only stores -inf for them. In a prefill
  that skips about half the pairs (the upper triangle, tile by tile).
- *FP8 keys.* e4m3 keys are converted to the dot's input type in registers (exact for bf16 and fp32).
  The per-key scale factors out of the dot, ``q . (s_k k8) = s_k (q . k8)``, so it multiplies each key's
  row of the [BLOCK_N, columns] logits and costs one 4-byte load per key.
- *Precision.* Accumulation is fp32. bf16/fp16 queries with keys of the same type (or fp8 keys) use
  the tensor cores in that type; anything involving fp32 uses an fp32 dot with
  ``input_precision="ieee"``, because tf32 would lose ~3 decimal digits against the reference. The CPU
  interpreter always computes in fp32: its ``tl.dot`` on bf16 operands returns garbage (docs/design.md
  §10, trap 9).
- *Block sizes* (``_tile_config``, from sweeps on the H200). Decode does H = 32 FLOP per bf16 key
  byte, so it should be memory-bound: 64 keys (one 16 KB bf16 tile at D = 128) per step in small
  2-warp programs, ~16 per SM, kept the most loads in flight. Prefill is compute-bound: 128 keys
  against 4 queries x 32 heads = 128 columns reuses each key tile 128 times per load. The CPU
  interpreter gets 16-key tiles and one chunk per row, because it pays per program and per tile
  element.
- *Binds:* decode with bf16 keys, HBM bandwidth on the key bytes; with fp8 keys, the fp8 -> bf16
  conversion and the narrow N = 32 dot, so they are no faster than bf16 ones; prefill, the tensor cores.

**Top-k** lives in ``topk_triton.py`` (a radix select over many programs per row).

fp64 inputs (used only by exactness tests) go to the reference: the kernel computes in fp32. No
atomics: every output element is written by exactly one program, so results are bitwise reproducible.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .._checks import check_tensor
from .checks import check_paged_scores_args
from .reference import index_scores_ref, paged_index_scores_ref

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# The block-table width (st_b) and T are not specialised on divisibility, nor the step metadata's addresses (a
# slice of one upload starts at any 8 bytes), so a new prompt length or step compiles no new variant (T = 1,
# decode, keeps its own). S, the key range per program and the weights' batch stride stay
# specialised: the FP8 decode scores are slower without them.
@triton.jit(do_not_specialize=["st_b"], do_not_specialize_on_alignment=["T", "table_ptr", "ctx_ptr", "pos_ptr"])
def _paged_scores_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, table_ptr, ctx_ptr, pos_ptr, out_ptr,
    T, H, D, S, block_size: tl.constexpr, keys_per_program, scale,  # constexpr: // and % by it become shifts
    sq_b, sq_t, sq_h, sq_d, sw_b, sw_t, sw_h,
    sk_blk, sk_row, sk_d, ss_blk, ss_row, st_b, st_m, sp_b, sp_t, so_b, so_t, so_s,
    BLOCK_T: tl.constexpr, H_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_POS: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a plane or the output may pass 2^31 elements
    t0 = tl.program_id(1) * BLOCK_T
    start = tl.program_id(2) * keys_per_program
    end = tl.minimum(start + keys_per_program, S)

    q_t, w, col_ok = _query_tile(q_ptr + b * sq_b, w_ptr + b * sw_b, t0, T, H, D, sq_t, sq_h, sq_d, sw_t, sw_h,
                                 BLOCK_T, H_PAD, BLOCK_D, DOT_DTYPE)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    t_out = t0 + tl.arange(0, BLOCK_T)
    out_cols = out_ptr + b * so_b + t_out[None, :] * so_t

    ctx = tl.load(ctx_ptr + b)
    if HAS_POS:  # keys after every query of the tile are never scored
        q_pos = tl.load(pos_ptr + b * sp_b + t_out * sp_t, mask=t_out < T, other=-1)
        ctx = tl.minimum(ctx, tl.max(q_pos) + 1)
    # Tiles from `start` up to the context end hold keys; the rest of the chunk is only -inf.
    live_end = tl.minimum(end, tl.maximum(ctx, start))
    for n0 in range(start, live_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        cached = (pos < ctx) & (pos < end)
        # The table read is masked too: a position past the context may lie past the table's last column.
        phys = tl.load(table_ptr + b * st_b + (pos // block_size) * st_m, mask=cached, other=-1)
        present = cached & (phys >= 0)
        slot = phys.to(tl.int64) * sk_blk + (pos % block_size) * sk_row
        k = tl.load(k_ptr + slot[:, None] + d[None, :] * sk_d, mask=present[:, None] & d_ok[None, :], other=0.0)
        logits = tl.dot(k.to(DOT_DTYPE), q_t, input_precision="ieee") * scale  # [BLOCK_N, cols] fp32
        if HAS_SCALE:
            kscale = tl.load(ks_ptr + phys.to(tl.int64) * ss_blk + (pos % block_size) * ss_row,
                             mask=present, other=0.0)
            logits = logits * kscale[:, None]
        weighted = tl.where(col_ok[None, :], tl.maximum(logits, 0.0) * w[None, :], 0.0)
        scores = tl.sum(tl.reshape(weighted, (BLOCK_N, BLOCK_T, H_PAD)), axis=2)  # [BLOCK_N, BLOCK_T]
        keep = present[:, None]  # past the context or no block: never selected
        if HAS_POS:
            keep = keep & (pos[:, None] <= q_pos[None, :])
        scores = tl.where(keep, scores, float("-inf"))
        tl.store(out_cols + pos[:, None] * so_s, scores, mask=(pos < end)[:, None] & (t_out < T)[None, :])

    # From the first tile start at or after live_end (on the chunk's BLOCK_N grid), only -inf.
    tail = start + tl.cdiv(live_end - start, BLOCK_N) * BLOCK_N
    _store_minus_inf(out_cols, tail, end, so_s, t_out < T, BLOCK_N, BLOCK_T)


@triton.jit
def _query_tile(q_row, w_row, t0, T, H, D, sq_t, sq_h, sq_d, sw_t, sw_h, BLOCK_T: tl.constexpr, H_PAD: tl.constexpr,
                BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The program's queries, transposed: query x head pairs are the dot's columns (c = t_local * H_PAD + h),
    loaded once and kept in registers -> (q_t [BLOCK_D, cols], w [cols] fp32, the real columns)."""
    cols = tl.arange(0, BLOCK_T * H_PAD)
    t = t0 + cols // H_PAD
    h = cols % H_PAD
    col_ok = (t < T) & (h < H)
    d = tl.arange(0, BLOCK_D)
    q_t = tl.load(q_row + t[None, :] * sq_t + h[None, :] * sq_h + d[:, None] * sq_d,
                  mask=(d < D)[:, None] & col_ok[None, :], other=0.0).to(DOT_DTYPE)
    w = tl.load(w_row + t * sw_t + h * sw_h, mask=col_ok, other=0.0).to(tl.float32)
    return q_t, w, col_ok


@triton.jit
def _store_minus_inf(out_cols, first, end, so_s, t_ok, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """-inf into the key positions first..end-1 of the program's query columns: no key is read."""
    for n0 in range(first, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        empty = tl.full((BLOCK_N, BLOCK_T), float("-inf"), tl.float32)
        tl.store(out_cols + pos[:, None] * so_s, empty, mask=(pos < end)[:, None] & t_ok[None, :])


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _dot_dtype(q: torch.Tensor, keys: torch.Tensor):
    """The type both dot operands are converted to: 16-bit tensor cores where that loses nothing."""
    if q.device.type != "cuda":
        return tl.float32
    half = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if q.dtype in half and (keys.dtype == q.dtype or keys.dtype in _FP8):
        return half[q.dtype]
    return tl.float32


def _tile_config(T: int, H: int, cuda: bool) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_T, H_PAD, BLOCK_N, num_warps, num_stages, programs per SM) for T queries of H heads."""
    h_pad = triton.next_power_of_2(H)
    if not cuda:  # interpreter: its cost grows with the program count and the tile area
        block_t = max(1, min(triton.next_power_of_2(T), 128 // h_pad))
        return block_t, max(h_pad, 16 // block_t), 16, 1, 1, 1
    if T == 1:  # decode: one query a program, its heads are the dot's columns (at least 16)
        return 1, max(16, h_pad), 64, 2, 2, 16
    # prefill: 128 keys against about 128 columns of query x head
    block_t = max(1, min(triton.next_power_of_2(T), 128 // h_pad))
    return block_t, max(h_pad, 16 // block_t), 128, 8, 2, 8


def _launch_scores(q, w, key_plane, key_scale_plane, block_table, context_lens, scale, q_pos=None,
                   keys_per_program=None) -> torch.Tensor:
    """Run the score kernel on checked inputs. ``keys_per_program`` (a multiple of the key tile) is
    for tests that need several key chunks at tiny sizes; None picks it from the machine."""
    B, T, H, D = q.shape
    bs = key_plane.shape[1]
    S = block_table.shape[1] * bs
    out = torch.empty(B, T, S, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_t, h_pad, block_n, warps, stages, per_sm = _tile_config(T, H, q.device.type == "cuda")
    tiles_t = triton.cdiv(T, block_t)
    key_tiles = triton.cdiv(S, block_n)
    if keys_per_program is None:
        if q.device.type == "cuda":
            # Enough programs per SM to keep loads in flight; never fewer than 8 key tiles a program.
            want = per_sm * _sm_count(q.device.index or 0)
            chunks = max(1, min(triton.cdiv(want, B * tiles_t), triton.cdiv(key_tiles, 8)))
        else:
            chunks = 1
        keys_per_program = triton.cdiv(key_tiles, chunks) * block_n
    if keys_per_program % block_n:
        raise ValueError(f"keys_per_program={keys_per_program} must be a multiple of {block_n}")
    ks = key_scale_plane if key_scale_plane is not None else key_plane  # a placeholder, never read
    ks_strides = (ks.stride(0), ks.stride(1)) if key_scale_plane is not None else (0, 0)
    pos = q_pos if q_pos is not None else context_lens  # a placeholder, never read
    pos_strides = q_pos.stride() if q_pos is not None else (0, 0)
    grid = (B, tiles_t, triton.cdiv(S, keys_per_program))
    _paged_scores_kernel[grid](
        q, w, key_plane, ks, block_table, context_lens, pos, out,
        T, H, D, S, bs, keys_per_program, float(scale),
        *q.stride(), *w.stride(), *key_plane.stride(), *ks_strides, *block_table.stride(), *pos_strides,
        *out.stride(),
        BLOCK_T=block_t, H_PAD=h_pad, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        HAS_SCALE=key_scale_plane is not None, HAS_POS=q_pos is not None, DOT_DTYPE=_dot_dtype(q, key_plane),
        num_warps=warps, num_stages=stages,
    )
    return out


def paged_index_scores(q: torch.Tensor, w: torch.Tensor, key_plane: torch.Tensor,
                       key_scale_plane: torch.Tensor | None, block_table: torch.Tensor,
                       context_lens: torch.Tensor, scale: float, q_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Index scores over each sequence's paged keys: the contract, shapes and dtypes of
    ``paged_index_scores_ref``, in one fused kernel (see the module docstring)."""
    check_paged_scores_args(q, w, key_plane, key_scale_plane, block_table, context_lens, q_pos)
    if torch.float64 in (q.dtype, w.dtype, key_plane.dtype):
        return paged_index_scores_ref(q, w, key_plane, key_scale_plane, block_table, context_lens, scale, q_pos)
    return _launch_scores(q, w, key_plane, key_scale_plane, block_table, context_lens, scale, q_pos)


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """I[b,t,s] = sum_h w[b,t,h] * ReLU(scale * q[b,t,h,:] . k[b,s,:]), no causal masking.

    q [B, T, H, D], k [B, S, D], w [B, T, H] -> [B, T, S] float32. Dense keys are the paged case with
    one block per sequence: k itself is the plane [B, S, D] and block b belongs to row b.
    """
    B, T, H, D = check_tensor("q", q, ndim=4, floating=True)
    S = check_tensor("k", k, shape=(B, None, D), floating=True)[1]
    check_tensor("w", w, shape=(B, T, H), floating=True)
    if torch.float64 in (q.dtype, k.dtype, w.dtype) or S == 0:
        return index_scores_ref(q, k, w, scale)
    table = torch.arange(B, dtype=torch.int32, device=q.device).view(B, 1)
    lens = torch.full((B,), S, dtype=torch.int32, device=q.device)
    return _launch_scores(q, w, k, None, table, lens, scale)
