"""Reference sparse MLA attention over the paged latent cache: the decode and the prefill form.

Both read the two latent planes of one MLA layer, kv_latent [num_blocks, block_size, r] (the
normalised c_kv) and k_pe [num_blocks, block_size, dr], through int32 block tables, at the int32
logical positions the indexer selected (-1 = padding, never read). Both equal ``sparse_attention``
on the dense, decompressed tensors; they differ in how much they read (docs/design.md §4):

* decode, absorbed / MQA form: gather exactly the K selected latent rows and attend with the
  latent as both key and value (the caller folds W_UK into q before and applies W_UV after);
* prefill, block-aggregated / MHA form: per tile of 64 queries, gather the union of KV blocks the
  tile selected once, decompress them with W_kvb and attend over that union with every key a query
  did not select masked out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import acc_dtype, check_tensor
from .._dispatch import op
from .._library import result_like
from ..attention.reference import attend, indices_to_mask, masked_dense_attention
from ..paging import gather_kv_slots, paged_kv_slots

PREFILL_TILE = 64  # queries whose selected blocks are gathered together in prefill


def decompress_kv(kv_latent: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor, num_heads: int,
                  nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_latent [B, S, r], k_pe [B, S, dr], kv_b_weight [H*(dn+dv), r] -> k [B, S, H, dn+dr], v [B, S, H, dv].

    [k_nope | v] = W_kvb c_kv per head (dn = ``nope_dim``); k_pe is shared by all heads. Computed in
    the weight's dtype (the model's compute dtype).
    """
    B, S, _ = kv_latent.shape
    dr = k_pe.shape[-1]
    kv = F.linear(kv_latent.to(kv_b_weight.dtype), kv_b_weight).view(B, S, num_heads, -1)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    k = torch.cat([k_nope, k_pe.to(k_nope.dtype).unsqueeze(2).expand(B, S, num_heads, dr)], dim=-1)
    return k, v


def check_decode_args(q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices) -> tuple[int, ...]:
    """Argument checks of ``sparse_mla_decode`` (reference and kernel alike) -> (B, T, H, r, dr, K)."""
    B, T, H, r = check_tensor("q_latent", q_latent, ndim=4, floating=True)
    dr = check_tensor("q_pe", q_pe, shape=(B, T, H, None), floating=True)[3]
    check_tensor("kv_latent_plane", kv_latent_plane, shape=(None, None, r))
    check_tensor("k_pe_plane", k_pe_plane, shape=(kv_latent_plane.shape[0], kv_latent_plane.shape[1], dr))
    check_tensor("block_table", block_table, shape=(B, None), integer=True)
    K = check_tensor("indices", indices, shape=(B, T, None), integer=True)[2]
    return B, T, H, r, dr, K


def check_prefill_args(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight) -> tuple[int, ...]:
    """Argument checks of ``sparse_mla_prefill`` (reference and kernel alike) -> (B, T, H, dn, dv)."""
    B, T, H, Dq = check_tensor("q", q, ndim=4, floating=True)
    _, bs, r = check_tensor("kv_latent_plane", kv_latent_plane, ndim=3)
    dr = check_tensor("k_pe_plane", k_pe_plane, shape=(kv_latent_plane.shape[0], bs, None))[2]
    check_tensor("block_table", block_table, shape=(B, None), integer=True)
    check_tensor("indices", indices, shape=(B, T, None), integer=True)
    dn = Dq - dr
    check_tensor("kv_b_weight", kv_b_weight, shape=(None, r), floating=True)
    if kv_b_weight.shape[0] % H or kv_b_weight.shape[0] // H <= dn:
        raise ValueError(f"kv_b_weight {tuple(kv_b_weight.shape)} must be [H * (dn + dv), r] with H={H}, dn={dn}")
    return B, T, H, dn, kv_b_weight.shape[0] // H - dn


@op(kernel="latent_triton", gluon="sm90_gluon",
    fake=lambda q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices, scale: result_like(q_latent, q_latent.shape))
def sparse_mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_latent_plane: torch.Tensor,
                          k_pe_plane: torch.Tensor, block_table: torch.Tensor, indices: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Absorbed sparse MLA attention over exactly the selected latent rows.

    Args:
        q_latent: [B, T, H, r] W_UK^T q_nope per head; q_pe: [B, T, H, dr].
        kv_latent_plane: [num_blocks, block_size, r]; k_pe_plane: [num_blocks, block_size, dr].
        block_table: int32 [B, max_blocks]; indices: int32 [B, T, K] logical positions, -1 = padding.
        scale: softmax scale (dn + dr)^-0.5.
    Returns:
        o_latent [B, T, H, r] float32 (float64 kept): sum_s p[s] c_kv[s]; W_UV is applied by the caller.
        score[s] = (q_latent . c_kv[s] + q_pe . k_pe[s]) * scale over the selected s only.
    """
    B, T, H, r, dr, K = check_decode_args(q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices)
    acc = acc_dtype(q_latent, q_pe)
    flat = indices.reshape(B, T * K)
    kv_slots = paged_kv_slots(block_table, flat, kv_latent_plane.shape[1])  # one address computation, two planes
    c_kv = gather_kv_slots(kv_latent_plane, kv_slots).to(acc).view(B, T, K, 1, r)
    k_pe = gather_kv_slots(k_pe_plane, kv_slots).to(acc).view(B, T, K, 1, dr)
    q = torch.cat([q_latent.to(acc), q_pe.to(acc)], dim=-1)
    # A position with no block (table entry -1, or past the table) is padding too: not read, not counted.
    return attend(q, torch.cat([c_kv, k_pe], dim=-1), c_kv, (kv_slots >= 0).view(B, T, K), scale)


@op(kernel="prefill_triton", gluon="sm90_gluon",
    fake=lambda q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale: result_like(
        q, (*q.shape[:3], kv_b_weight.shape[0] // q.shape[2] - (q.shape[3] - k_pe_plane.shape[-1]))))
def sparse_mla_prefill(q: torch.Tensor, kv_latent_plane: torch.Tensor, k_pe_plane: torch.Tensor,
                           block_table: torch.Tensor, indices: torch.Tensor, kv_b_weight: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Block-aggregated sparse MLA attention in decompressed (MHA) form.

    Args:
        q: [B, T, H, dn + dr] queries [q_nope | q_pe].
        kv_latent_plane: [num_blocks, block_size, r]; k_pe_plane: [num_blocks, block_size, dr].
        block_table: int32 [B, max_blocks]; indices: int32 [B, T, K] logical positions, -1 = padding.
        kv_b_weight: [H * (dn + dv), r] the W_kvb that decompresses c_kv into [k_nope | v] per head.
        scale: softmax scale (dn + dr)^-0.5.
    Returns:
        [B, T, H, dv] float32 (float64 kept).
    Per sequence and tile of PREFILL_TILE queries, the KV blocks any query of the tile selected are
    gathered once (sorted by logical block), decompressed, and attended densely with each query's
    unselected keys masked out. The loops and ``unique`` are fine here: prefill may synchronise, decode never does.
    """
    B, T, H, dn, dv = check_prefill_args(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight)
    out = torch.empty(B, T, H, dv, dtype=acc_dtype(q), device=q.device)
    for b in range(B):
        for t0 in range(0, T, PREFILL_TILE):
            tile = indices[b: b + 1, t0: t0 + PREFILL_TILE].long()  # [1, t, K]
            out[b: b + 1, t0: t0 + tile.shape[1]] = _prefill_tile(
                q[b: b + 1, t0: t0 + PREFILL_TILE], kv_latent_plane, k_pe_plane, block_table[b: b + 1], tile,
                kv_b_weight, scale)
    return out


def _prefill_tile(q, kv_latent_plane, k_pe_plane, table, tile, kv_b_weight, scale) -> torch.Tensor:
    """One tile of one sequence: q [1, t, H, dn+dr], tile [1, t, K] -> [1, t, H, dv]."""
    bs = kv_latent_plane.shape[1]
    H, dr = q.shape[2], k_pe_plane.shape[-1]
    blocks = torch.unique(tile[tile >= 0] // bs)  # sorted logical blocks the tile touches
    if blocks.numel() == 0:
        return q.new_zeros(q.shape[:3] + (kv_b_weight.shape[0] // H - (q.shape[-1] - dr),), dtype=acc_dtype(q))
    positions = (blocks.view(-1, 1) * bs + torch.arange(bs, device=q.device)).view(1, -1)  # whole blocks
    kv_slots = paged_kv_slots(table, positions, bs)  # one address computation, two planes
    latent = gather_kv_slots(kv_latent_plane, kv_slots)
    k_pe = gather_kv_slots(k_pe_plane, kv_slots)
    k, v = decompress_kv(latent, k_pe, kv_b_weight, H, q.shape[-1] - dr)  # [1, U, H, *] over the union
    rank = torch.full((int(blocks.max()) + 1,), -1, dtype=torch.long, device=q.device)
    rank[blocks] = torch.arange(blocks.numel(), device=q.device)
    safe = tile.clamp_min(0)
    local = torch.where(tile >= 0, rank[safe // bs] * bs + safe % bs, torch.full_like(tile, -1))
    has_block = (kv_slots[0] >= 0)[local.clamp_min(0)]  # a position whose block is -1 is padding too
    mask = indices_to_mask(torch.where(has_block, local, torch.full_like(local, -1)), k.shape[1])  # [1, t, U]
    # Scores against the whole union, the unselected masked out: a dense product, not a gather per query.
    # A union row no query selected (past the written length of a block) may hold anything, even NaN:
    # selected away, never multiplied by a zero probability (docs/design.md §10, trap 4).
    v = torch.where(mask.any(dim=1).view(1, -1, 1, 1), v, torch.zeros((), dtype=v.dtype, device=v.device))
    return masked_dense_attention(q, k, v, mask, scale)


# The plain references by the names the kernels' fallbacks and the tests call them.
sparse_mla_decode_ref = sparse_mla_decode.reference
sparse_mla_prefill_ref = sparse_mla_prefill.reference
