"""Sparse MLA prefill on Triton: masked attention over each query tile's union of selected positions, in
decompressed (MHA) form, or the absorbed form of latent_triton.py where that is faster.

Same contract and signature as ``reference.sparse_mla_prefill_ref`` (docs/design.md §4, §12): q [B, T, H, dn + dr]
against the paged latent planes at the positions the indexer selected, out [B, T, H, dv] fp32. The reference
gathers, per tile of 64 queries, the union of the cache blocks the tile selected, decompresses them and attends
with remapped indices. The union form here aggregates the same way at the granularity of single positions, in
four stages:

1. Decompress once (``_decompress``): the positions below S, read block by block in logical order and multiplied
   by W_kvb in one GEMM, kv [B, S, H, dn + dv] in the weight's dtype (the reference's rounding); k_pe [B, S, dr]
   stays one vector per position, shared by the heads. S is the block table's reach, or the highest selection
   + 1 when the table reaches past twice the prompt, so that the work follows the selections, not the table.
2. Bit rows: one bit per (query, valid selected position) (prefill_union_triton.py).
3. Per tile of BLOCK_M queries, the sorted union of its queries' positions, and each query's selection as bits
   over that union, a chunk's words for the tile's queries contiguous (prefill_union_triton.py).
4. FlashAttention over each tile's union, one head per program, masked by those bits (prefill_attn_triton.py;
   prefill_gluon.py where it fits, in the op's sm_90 form, sm90_gluon.py).

Why positions and not blocks: a tile costs BLOCK_M x (union size) x 2 (dn + dr + dv) FLOPs per head, and a union
of positions is never larger than the union of the blocks holding them. When neighbouring queries keep most of
each other's picks (an indexer's scores move slowly from one query to the next) a tile's union is a small
multiple of top-k even when the picks are scattered over the whole prefix, while 2,048 scattered picks touch
nearly every 64-position block.

Which form runs: prefill_form.py decides from the unions' exact pair count once they are built (cheap, and the
union form reuses them); MINIDSA_PREFILL_FORM forces one. Two host syncs at most: S (the highest selection), only
when the block table reaches past twice the prompt, and the counts (pairs, selections, mask words), copied to
pinned memory as soon as the unions are built. The decompression is queued before the host waits for that copy,
so the GPU has work while the host wakes up and launches the masks and the attention.

Against the reference: a row of the union that one query of a tile selected is read for every query of the tile
(with p = 0 for the others), so a NaN stored in that row reaches the whole tile, where the reference reads it
only for the queries that selected it. fp64 inputs go to the reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton

from . import prefill_attn_triton, prefill_form
from .latent_triton import sparse_mla_prefill_absorbed
from .prefill_union_triton import bitmaps, tile_masks, tile_unions
from .reference import check_prefill_args, sparse_mla_prefill_ref


def _decompress(kv_latent_plane, k_pe_plane, table, kv_b_weight, B: int, H: int):
    """Every position the given block table reaches (its width x block_size), decompressed, in logical order:
    (kv [B, S, H, dn + dv], k_pe [B, S, dr]) in the weight's dtype. Whole blocks are gathered; a -1 entry
    stands in block 0, whose rows are then never read (no selection there is valid)."""
    blocks = table.clamp(min=0)
    wdt = kv_b_weight.dtype
    latent = kv_latent_plane[blocks].view(B, -1, kv_latent_plane.shape[-1]).to(wdt)  # [B, S, r]
    kv = F.linear(latent, kv_b_weight).view(B, latent.shape[1], H, -1)
    return kv, k_pe_plane[blocks].view(B, -1, k_pe_plane.shape[-1]).to(wdt)


def _fetch_later(t: torch.Tensor):
    """Start copying the small tensor t to the host without waiting -> a function that waits for that copy
    alone, not for the GPU work queued after it, and returns t's values as a list."""
    if t.device.type != "cuda":
        return t.tolist
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))

    def wait() -> list:
        copied.synchronize()
        return host.tolist()
    return wait


def sparse_mla_prefill(q: torch.Tensor, kv_latent_plane: torch.Tensor, k_pe_plane: torch.Tensor,
                       block_table: torch.Tensor, indices: torch.Tensor, kv_b_weight: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Sparse MLA prefill: the contract, shapes and dtypes of ``sparse_mla_prefill_ref``. Masked attention
    over each query tile's union of selected positions, or the absorbed per-query form when the unions are
    too large for that to pay (prefill_form.py)."""
    return prefill(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale)


def prefill(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale, union_gluon=None,
            latent_gluon=None):
    """``sparse_mla_prefill``, each attention on its sm_90 module where that fits the call: ``union_gluon``
    (prefill_gluon.py) the union form's, ``latent_gluon`` (latent_gluon.py) the absorbed form's; None: Triton."""
    B, T, H, dn, dv = check_prefill_args(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight)
    args = (q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale)
    if torch.float64 in (q.dtype, kv_latent_plane.dtype, k_pe_plane.dtype, kv_b_weight.dtype):
        return sparse_mla_prefill_ref(*args)
    absorbed = functools.partial(sparse_mla_prefill_absorbed, *args, gluon=latent_gluon)
    bs, on_gpu = kv_latent_plane.shape[1], q.device.type == "cuda"
    reach = block_table.shape[1] * bs
    # A table that reaches no further than top-k (prompts shorter than top-k): a tile's union holds at most
    # top-k positions, so the union form is never costlier than the absorbed one with full selections (and
    # the indexer selects all a query sees: its best case). Its buffers follow from the shapes: no read-back.
    whole = 0 < reach <= indices.shape[-1] and prefill_form.FORM != "absorbed"
    if B * T == 0 or indices.shape[-1] == 0 or prefill_form.FORM == "absorbed" or (
            prefill_form.must_not_sync() and not whole):
        return absorbed()
    BLOCK_M, BLOCK_N, num_warps, num_stages = prefill_attn_triton.tile_config(on_gpu, kv_b_weight.element_size())
    idx, table = indices.to(torch.int32), block_table.to(torch.int32)
    # S bounds every position the op marks, ORs and decompresses. A table that reaches at most twice the
    # prompt (a prefill without a long prefix) or at most top-k sets it, with no host sync before the union
    # build. A wider one (a long prefix, or a table made for a longer sequence: 128k positions for a 1k prompt)
    # costs a sync for the highest selection instead, so that the work follows the selections and not the
    # table (the sync costs time: the GPU drains while the host waits).
    S = reach if reach <= 2 * T or whole else min(int(idx.max()) + 1, reach)
    if S <= 0:  # no block, or nothing selected anywhere: the absorbed form returns zeros
        return absorbed()
    bits, n_valid = bitmaps(idx, table, bs, B, T, S, on_gpu)
    union, count, mask_off, stats = tile_unions(bits, n_valid, B, T, S, BLOCK_M, on_gpu)
    work = None if whole else _fetch_later(stats)
    # Queued before the host waits for the counts: the GPU decompresses while the host wakes up and launches
    # the masks (wasted when the absorbed form wins).
    kv, k_pe = _decompress(kv_latent_plane, k_pe_plane, table[:, :triton.cdiv(S, bs)], kv_b_weight, B, H)
    q = q if q.stride(-1) == 1 else q.contiguous()
    gluon = prefill_attn_triton.gluon_attends(union_gluon, q, kv, k_pe, dn, scale, BLOCK_M)  # it sets the cost
    if whole:  # the masks' words: at most ceil(S / 32) per query of every tile
        total = B * triton.cdiv(T, BLOCK_M) * BLOCK_M * triton.cdiv(S, 32)
    else:
        pairs, selected, total = work()  # waits for the counts' copy alone
        if not prefill_form.use_union_form(pairs, selected, H, gluon is not None):
            return absorbed()
    mask = tile_masks(bits, union, count, mask_off, total, T, BLOCK_M, on_gpu)
    del bits  # 4 bytes per query and 32 positions, no longer needed: free them before attention runs
    out = torch.empty(B, T, H, dv, dtype=torch.float32, device=q.device)
    prefill_attn_triton.attend(q, kv, k_pe, union, count, mask, mask_off, out, dn, scale, BLOCK_M, BLOCK_N,
                               num_warps, num_stages, gluon)
    return out
