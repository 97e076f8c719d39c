"""Gated Multi-head Latent Attention with DeepSeek Sparse Attention (SPEC sections 2 and 4).

Projections (x = RMSNorm of the layer input, d wide):
    c_q = RMSNorm(W_qa x);   q = W_qb c_q            -> per head [q_nope (dn) | q_pe (dr)]
    [c_kv | k_pe] = W_kva x; c_kv = RMSNorm(c_kv)    -> the only per-token state: kv_lora + dr values
    [k_nope | v] = W_kvb c_kv                        -> per head, decompressed on demand
    score = (q_nope . k_nope + q_pe . k_pe) / sqrt(dn + dr), over the indexer's top-k keys only
    out = W_o [ softmax(score) v  *  sigmoid(W_g x) ]

Three ways to run the same function:
  * no cache (``model(input_ids)``): the plain reference every cached path must match;
  * prefill (many query tokens): writes the cache, then per query tile gathers whole KV blocks
    touched by the tile's selections, decompresses them and attends (compute-bound "MHA mode");
  * decode (one query token per sequence): gathers exactly the top-k latent rows and attends in the
    absorbed form q_lat = W_UK^T q_nope, o = W_UV (sum_s p_s c_kv[s]) ("MQA mode", memory-bound).
No rotary embedding anywhere: the KDA layers carry position information in the full model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import ops
from .config import ModelConfig
from .kv_cache import PagedKVCache
from .lightning_indexer import LightningIndexer
from .norm import RMSNorm
from .ops import acc_dtype

PREFILL_TILE = 64  # query tokens whose selected blocks are gathered together in prefill


@dataclass
class CacheContext:
    """Where the tokens of one cached forward live. B sequences, T new tokens each."""

    cache: PagedKVCache
    seq_ids: list[int]  # cache sequence of each batch row
    positions: torch.Tensor  # long [B, T] absolute positions of the new tokens
    slots: torch.Tensor  # long [B, T] physical slots of the new tokens
    key_slots: torch.Tensor  # long [B, S] slot of every position 0..S-1, -1 past a sequence's end
                             # (computed once per forward, shared by all layers)
    staged: dict = field(default_factory=dict)  # (kda layer, state name) -> new state [B, ...]

    def stage_state(self, layer: int, name: str, value: torch.Tensor) -> None:
        """Keep a KDA layer's new state until the whole forward succeeds (then the model writes it)."""
        self.staged[(layer, name)] = value

    def slots_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Logical positions [B, N] (-1 = padding) -> physical slots [B, N] (-1 kept)."""
        safe = positions.long().clamp_min(0)
        return torch.where(positions >= 0, self.key_slots.gather(1, safe), torch.full_like(safe, -1))


class GatedMLA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, cache_layer: int) -> None:
        super().__init__()
        m = cfg.mla
        self.layer_idx = layer_idx  # position in the decoder (for traces)
        self.cache_layer = cache_layer  # index among MLA layers (for the KV cache)
        self.num_heads, self.dn, self.dr, self.dv, self.r = (
            m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank)
        self.q_a_proj = nn.Linear(cfg.hidden_size, m.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(m.q_lora_rank, m.num_heads * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.r + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.r, m.num_heads * (self.dn + self.dv), bias=False)
        self.g_proj = nn.Linear(cfg.hidden_size, m.num_heads * self.dv, bias=False)
        self.o_proj = nn.Linear(m.num_heads * self.dv, cfg.hidden_size, bias=False)
        self.indexer = LightningIndexer(cfg)
        self.softmax_scale = (self.dn + self.dr) ** -0.5
        self.backend = "auto"  # op backend; the model sets it for all layers

    # ---------------------------------------------------------------- pieces shared by all paths
    def _project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [B, T, d] -> queries, latent KV planes, gate and indexer inputs of every token."""
        B, T, _ = x.shape
        c_q = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(c_q).view(B, T, self.num_heads, self.dn + self.dr)
        kv = self.kv_a_proj_with_mqa(x)
        q_idx, w_idx = self.indexer.queries(c_q, x)
        acc = acc_dtype(x)
        return dict(
            q=q,
            kv_latent=self.kv_a_layernorm(kv[..., : self.r]),  # [B, T, r]
            k_pe=kv[..., self.r:],  # [B, T, dr]
            gate=torch.sigmoid(self.g_proj(x).to(acc)),  # [B, T, H*dv], elementwise output gate
            q_idx=q_idx, w_idx=w_idx,
            **self.indexer.keys(x),
        )

    def decompress(self, kv_latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_latent [B, S, r], k_pe [B, S, dr] -> k [B, S, H, dn+dr], v [B, S, H, dv]."""
        B, S, _ = kv_latent.shape
        kv = self.kv_b_proj(kv_latent.to(self.kv_b_proj.weight.dtype)).view(B, S, self.num_heads, self.dn + self.dv)
        k_nope, v = kv[..., : self.dn], kv[..., self.dn:]
        k = torch.cat([k_nope, k_pe.to(k_nope.dtype).unsqueeze(2).expand(B, S, self.num_heads, self.dr)], dim=-1)
        return k, v

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_kvb split per head: W_UK [H, dn, r] and W_UV [H, dv, r]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.r)
        return w[:, : self.dn], w[:, self.dn:]

    def _finish(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, dv] (fp32), gate [B, T, H*dv] -> W_o(o * gate) [B, T, d]."""
        B, T = o.shape[:2]
        o = o.reshape(B, T, -1) * gate.to(o.dtype)
        return self.o_proj(o.to(self.o_proj.weight.dtype))

    # ---------------------------------------------------------------- entry point
    def forward(self, x: torch.Tensor, ctx: CacheContext | None = None, trace=None) -> torch.Tensor:
        """x [B, T, d] (already normalised) -> [B, T, d]. With a ForwardTrace, ``trace.selected[layer_idx]``
        gets the selected positions int32 [B, T, topk]."""
        p = self._project(x)
        if ctx is None:
            idx, o = self._forward_uncached(p)
        else:
            self._write_cache(ctx, p)
            idx = self._select_cached(ctx, p)
            # The path is chosen from the number of query tokens (SPEC section 4).
            o = self._attend_decode(ctx, p, idx) if x.shape[1] == 1 else self._attend_prefill(ctx, p, idx)
        if trace is not None:
            trace.selected[self.layer_idx] = idx
        return self._finish(o, p["gate"])

    # ---------------------------------------------------------------- no cache: the reference
    def _forward_uncached(self, p: dict) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = p["q"].shape[:2]
        k_idx = self.indexer.dequant_keys(p)
        q_pos = torch.arange(T, device=k_idx.device).expand(B, T)
        idx = self.indexer.select(p["q_idx"], p["w_idx"], k_idx, q_pos, self.backend)
        k, v = self.decompress(p["kv_latent"], p["k_pe"])
        return idx, ops.sparse_attention(p["q"], k, v, idx, self.softmax_scale, backend=self.backend)

    # ---------------------------------------------------------------- cached paths
    def _planes(self, p: dict) -> dict[str, torch.Tensor]:
        return {name: p[name] for name in ("kv_latent", "k_pe", "index_key", "index_key_scale") if name in p}

    def _write_cache(self, ctx: CacheContext, p: dict) -> None:
        slots = ctx.slots.reshape(-1)
        for name, value in self._planes(p).items():
            ctx.cache.write(self.cache_layer, name, slots, value.reshape(slots.numel(), -1))

    def _select_cached(self, ctx: CacheContext, p: dict) -> torch.Tensor:
        """Indexer over every cached key of each sequence (new tokens included) -> int32 [B, T, topk]."""
        # Positions past a sequence's last token have slot -1 and read as zeros; they are never
        # candidates (they exceed every q_pos of that row), so this padding is safe.
        planes = {name: ctx.cache.gather(self.cache_layer, name, ctx.key_slots)
                  for name in ("index_key", "index_key_scale") if name in p}
        k_idx = self.indexer.dequant_keys(planes)  # [B, S, D_I]
        return self.indexer.select(p["q_idx"], p["w_idx"], k_idx, ctx.positions, self.backend)

    def _attend_prefill(self, ctx: CacheContext, p: dict, idx: torch.Tensor) -> torch.Tensor:
        """Block-aggregated gather: per sequence and query tile, fetch whole KV blocks that any
        query of the tile selected, decompress them once and attend with remapped indices."""
        cache, bs = ctx.cache, ctx.cache.block_size
        B, T = idx.shape[:2]
        out = torch.empty(B, T, self.num_heads, self.dv,
                          dtype=acc_dtype(p["q"]),
                          device=idx.device)
        for b, sid in enumerate(ctx.seq_ids):
            for t0 in range(0, T, PREFILL_TILE):
                tile = idx[b: b + 1, t0: t0 + PREFILL_TILE].long()  # [1, t, K]
                sel = tile[tile >= 0]
                blocks = torch.unique(sel // bs)  # sorted logical blocks the tile touches
                if blocks.numel() == 0:
                    out[b, t0: t0 + tile.shape[1]] = 0
                    continue
                kv_latent = cache.gather_blocks(self.cache_layer, "kv_latent", sid, blocks).unsqueeze(0)
                k_pe = cache.gather_blocks(self.cache_layer, "k_pe", sid, blocks).unsqueeze(0)
                k, v = self.decompress(kv_latent, k_pe)
                rank = torch.full((int(blocks.max()) + 1,), -1, dtype=torch.long, device=idx.device)
                rank[blocks] = torch.arange(blocks.numel(), device=idx.device)
                safe = tile.clamp_min(0)
                local = torch.where(tile >= 0, rank[safe // bs] * bs + safe % bs, torch.full_like(tile, -1))
                out[b: b + 1, t0: t0 + tile.shape[1]] = ops.sparse_attention(
                    p["q"][b: b + 1, t0: t0 + PREFILL_TILE], k, v, local, self.softmax_scale,
                    backend=self.backend)
        return out

    def _attend_decode(self, ctx: CacheContext, p: dict, idx: torch.Tensor) -> torch.Tensor:
        """Absorbed form over exactly the top-k latent rows. idx int32 [B, 1, K] -> o [B, 1, H, dv]."""
        cache = ctx.cache
        B, _, K = idx.shape
        slots = ctx.slots_of(idx[:, 0])  # [B, K]
        kv_latent = cache.gather(self.cache_layer, "kv_latent", slots)  # [B, K, r]; -1 -> zeros, unread
        k_pe = cache.gather(self.cache_layer, "k_pe", slots)  # [B, K, dr]
        acc = acc_dtype(p["q"])
        w_uk, w_uv = self.absorbed_weights()
        q = p["q"].to(acc)
        q_lat = torch.einsum("bthn,hnr->bthr", q[..., : self.dn], w_uk.to(acc))  # [B, 1, H, r]
        q_abs = torch.cat([q_lat, q[..., self.dn:]], dim=-1)  # [B, 1, H, r + dr]
        k_abs = torch.cat([kv_latent.to(acc), k_pe.to(acc)], dim=-1).unsqueeze(2)  # [B, K, 1, r + dr]
        local = torch.arange(K, device=idx.device).view(1, 1, K).expand(B, 1, K)
        local = torch.where(idx >= 0, local, torch.full_like(local, -1))
        o_lat = ops.sparse_attention(q_abs, k_abs, kv_latent.to(acc).unsqueeze(2), local, self.softmax_scale,
                                     backend=self.backend)  # [B, 1, H, r]
        return torch.einsum("bthr,hvr->bthv", o_lat, w_uv.to(acc))
