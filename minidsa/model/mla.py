"""Gated Multi-head Latent Attention with DeepSeek Sparse Attention (docs/design.md §2, §4).

Projections (x = RMSNorm of the layer input, d wide):
    c_q = RMSNorm(W_qa x);   q = W_qb c_q            -> per head [q_nope (dn) | q_pe (dr)]
    [c_kv | k_pe] = W_kva x; c_kv = RMSNorm(c_kv)    -> the only per-token state: kv_lora + dr values
    [k_nope | v] = W_kvb c_kv                        -> per head, decompressed on demand
    score = (q_nope . k_nope + q_pe . k_pe) / sqrt(dn + dr), over the indexer's top-k keys only
    out = W_o [ softmax(score) v  *  sigmoid(W_g x) ]

Three ways to run the same function:
  * no cache (``model(input_ids)``): the plain reference every cached path must match;
  * prefill (many query tokens): store the new rows, select over the paged index keys, then
    ``ops.sparse_mla_prefill`` gathers per query tile the KV blocks the tile selected, decompresses
    them and attends (compute-bound "MHA mode");
  * decode (one query token per sequence): the same store and selection, then
    ``ops.sparse_mla_decode`` attends over exactly the top-k latent rows in the absorbed form
    q_lat = W_UK^T q_nope, o = W_UV (sum_s p_s c_kv[s]) ("MQA mode", memory-bound).
Each cached path is projections plus op calls: the ops are where kernels plug in (docs/design.md §12).
No rotary embedding anywhere: the KDA layers carry position information in the full model.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..cache import CacheContext, Plane, StepContext
from ..config import ModelConfig
from ..ops import acc_dtype, cast
from .fused import FusedLinears
from .indexer import LightningIndexer
from .norm import RMSNorm
from .trace import ForwardTrace, held_choice, token_pieces

# The released modeling code builds the two latent norms without an eps, so they run at the RMSNorm class
# default, 1e-6, not the model's rms_norm_eps (1e-5), as DeepSeek-V3.2 does (docs/design.md §2).
LATENT_NORM_EPS = 1e-6


class GatedMLA(nn.Module):
    parallel = None  # a distributed Comm when the heads are split over ranks (minidsa/distributed)

    def __init__(self, cfg: ModelConfig, layer_idx: int, cache_layer: int) -> None:
        super().__init__()
        m = cfg.mla
        self.layer_idx = layer_idx  # position in the decoder (for traces)
        self.cache_layer = cache_layer  # index among MLA layers: which planes of the KV cache are this layer's
        self.num_heads, self.dn, self.dr, self.dv, self.r = (
            m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank)
        self.q_a_proj = nn.Linear(cfg.hidden_size, m.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = nn.Linear(m.q_lora_rank, m.num_heads * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.r + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.r, m.num_heads * (self.dn + self.dv), bias=False)
        self.g_proj = nn.Linear(cfg.hidden_size, m.num_heads * self.dv, bias=False)
        self.o_proj = nn.Linear(m.num_heads * self.dv, cfg.hidden_size, bias=False)
        self.indexer = LightningIndexer(cfg)
        self.softmax_scale = (self.dn + self.dr) ** -0.5
        # the five projections of the layer input, then the two of the compressed query, each one product
        self.input_proj = FusedLinears(self.q_a_proj, self.kv_a_proj_with_mqa, self.indexer.wk, self.g_proj,
                                       self.indexer.weights_proj)
        self.query_proj = FusedLinears(self.q_b_proj, self.indexer.wq_b)

    @staticmethod
    def cache_planes(cfg: ModelConfig, dtype: torch.dtype) -> tuple[Plane, ...]:
        """What one MLA layer keeps per token: the latent c_kv and k_pe, plus the indexer key's planes."""
        return (Plane("kv_latent", cfg.mla.kv_lora_rank, dtype), Plane("k_pe", cfg.mla.qk_rope_head_dim, dtype),
                *LightningIndexer.cache_planes(cfg, dtype))

    # ---------------------------------------------------------------- pieces shared by all paths
    def _project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [B, T, d] -> queries, latent KV rows, gate and indexer inputs of every token."""
        B, T, _ = x.shape
        q_a, kv, k_idx, g, w_idx = self.input_proj(x)
        q, q_idx = self.query_proj(self.q_a_layernorm(q_a))
        return dict(
            q=q.view(B, T, self.num_heads, self.dn + self.dr),
            kv_latent=self.kv_a_layernorm(kv[..., : self.r]),  # [B, T, r]
            k_pe=kv[..., self.r:],  # [B, T, dr]
            gate=g,  # [B, T, H*dv]: the output gate's pre-activation
            q_idx=self.indexer.head_queries(q_idx), w_idx=self.indexer.head_weights(w_idx),
            **self.indexer.key_planes(k_idx),
        )

    def decompress(self, kv_latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_latent [B, S, r], k_pe [B, S, dr] -> k [B, S, H, dn+dr], v [B, S, H, dv]."""
        return ops.decompress_kv(kv_latent, k_pe, self.kv_b_proj.weight, self.num_heads, self.dn)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_kvb split per head: W_UK [H, dn, r] and W_UV [H, dv, r]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.r)
        return w[:, : self.dn], w[:, self.dn:]

    def _finish(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, dv] (fp32), gate [B, T, H*dv] (pre-activation) -> W_o(o * sigmoid(gate)) [B, T, d]."""
        o = ops.output_gate(o, gate, None, 1e-6, self.o_proj.weight.dtype)
        out = ops.linear(o, self.o_proj.weight)
        return out if self.parallel is None else self.parallel.tp_all_reduce(out)  # this rank's heads: partial

    # ---------------------------------------------------------------- entry point
    def forward(self, x: torch.Tensor, ctx: CacheContext | None = None,
                trace: ForwardTrace | None = None) -> torch.Tensor:
        """x [B, T, d] (already normalised) -> [B, T, d]. With a ForwardTrace, ``trace.selected[layer_idx]``
        gets the selected positions int32 [B, T, topk]."""
        proj = self._project(x)
        if isinstance(ctx, StepContext):
            idx, o = self._forward_step(ctx, proj, trace)
        elif ctx is None:
            idx, o = self._forward_uncached(proj, trace)
        else:
            idx = self._store_and_select(ctx, proj, trace)
            # The path is chosen from the number of query tokens (docs/design.md §4).
            o = self._attend_decode(ctx, proj, idx) if x.shape[1] == 1 else self._attend_prefill(ctx, proj, idx)
        if trace is not None:
            trace.selected[self.layer_idx] = idx
        return self._finish(o, proj["gate"])

    # ---------------------------------------------------------------- no cache: the reference
    def _forward_uncached(self, proj: dict, trace: ForwardTrace | None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = proj["q"].shape[:2]
        q_pos = torch.arange(T, device=proj["q"].device).expand(B, T)
        idx = self._select(lambda: token_pieces(None, B, T), trace, lambda: self.indexer.select(
            proj["q_idx"], proj["w_idx"], self.indexer.dequant_keys(proj), q_pos))
        k, v = self.decompress(proj["kv_latent"], proj["k_pe"])
        return idx, ops.sparse_attention(proj["q"], k, v, idx, self.softmax_scale)

    # ---------------------------------------------------------------- one packed engine step
    def _forward_step(self, step: StepContext, proj: dict, trace: ForwardTrace | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens of several sequences on one axis ([1, N, ...]): every new row stored with one call, then the
        decode rows selected and attended together, then the prefill pieces together, each over its own
        sequence's keys.
        -> (int32 [1, N, topk], o [1, N, H, dv])."""
        planes = self._store(step.cache, step.kv_slots, proj)
        parts = []
        n = step.num_decode
        if n:
            ctx = step.decode_part()
            rows = {k: v[0, :n].unsqueeze(1) for k, v in proj.items()}  # [n, 1, ...]: one row per sequence
            idx = self._select(lambda: step.pieces_on_axis(True), trace,
                               lambda: self.indexer.select_paged(rows["q_idx"], rows["w_idx"], planes, ctx))
            parts.append((idx.view(1, n, -1), self._attend_decode(ctx, rows, idx).flatten(0, 1).unsqueeze(0)))
        if step.prefill_rows:  # every prefill piece in one [P', T_max] rectangle, padded where lengths differ
            ctx = step.prefill_part()
            rect = {k: step.pad(proj[k]) for k in ("q", "q_idx", "w_idx")}
            idx = self._select(lambda: step.pieces_on_axis(False), trace,  # -1 on padding rows
                               lambda: self.indexer.select_paged(rect["q_idx"], rect["w_idx"], planes, ctx),
                               lambda i: step.unpad(i)[0], lambda f: step.pad(f.unsqueeze(0), fill=-1))
            parts.append((step.unpad(idx), step.unpad(self._attend_prefill(ctx, rect, idx))))
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)

    # ---------------------------------------------------------------- cached paths: projections + ops
    def _store_and_select(self, ctx: CacheContext, proj: dict, trace: ForwardTrace | None) -> torch.Tensor:
        """Store the new tokens' rows, then select over every cached key (new ones included): int32 [B, T, topk]."""
        planes = self._store(ctx.cache, ctx.kv_slots, proj)
        B, T = proj["q"].shape[:2]
        return self._select(lambda: token_pieces(ctx, B, T), trace,
                            lambda: self.indexer.select_paged(proj["q_idx"], proj["w_idx"], planes, ctx))

    def _select(self, pieces, trace: ForwardTrace | None, select, flat=None, unflat=None) -> torch.Tensor:
        """select() -> int32 [R, T, topk], or the selection a trace holds for the pieces ``pieces()`` names
        (model/trace.py)."""
        return held_choice(trace, self.indexer, pieces, select, flat or (lambda i: i.flatten(0, 1)),
                           unflat or (lambda f: f.view(len(pieces()), -1, f.shape[-1])))

    def _store(self, cache, kv_slots: torch.Tensor, proj: dict) -> dict[str, torch.Tensor]:
        """Write every new token's row of each plane at its slot (kv_slots [n], -1 = skip); -> this layer's planes."""
        planes = {name: cache.plane(self.cache_layer, name) for name in cache.layout.plane_names}
        for name, plane in planes.items():
            ops.store_kv(plane, kv_slots, proj[name].reshape(kv_slots.numel(), -1))
        return planes

    def _attend_prefill(self, ctx: CacheContext, proj: dict, idx: torch.Tensor) -> torch.Tensor:
        """Block-aggregated gather + decompressed attention -> o [B, T, H, dv] fp32."""
        return ops.sparse_mla_prefill(proj["q"], ctx.cache.plane(self.cache_layer, "kv_latent"),
                                      ctx.cache.plane(self.cache_layer, "k_pe"), ctx.block_table, idx,
                                      self.kv_b_proj.weight, self.softmax_scale)

    def _attend_decode(self, ctx: CacheContext, proj: dict, idx: torch.Tensor) -> torch.Tensor:
        """Absorbed form over exactly the top-k latent rows: W_UK into q, attend, W_UV out -> [B, T, H, dv]."""
        acc = acc_dtype(proj["q"])
        w_uk, w_uv = self.absorbed_weights()
        q = cast(proj["q"], acc)
        # Per head: q_latent[h] = q_nope[h] @ W_UK[h] and o[h] = o_latent[h] @ W_UV[h]^T, one product batched
        # over heads with the B*T queries as its rows (a broadcasting matmul over [B, T, H, 1, dn] would copy
        # the weights once per query: at batch 32 that copy outweighed the attention).
        q_latent = torch.einsum("bthd,hdr->bthr", q[..., : self.dn], cast(w_uk, acc))  # [B, T, H, r]
        o_latent = ops.sparse_mla_decode(q_latent, q[..., self.dn:], ctx.cache.plane(self.cache_layer, "kv_latent"),
                                         ctx.cache.plane(self.cache_layer, "k_pe"), ctx.block_table, idx,
                                         self.softmax_scale)
        return torch.einsum("bthr,hvr->bthv", o_latent, cast(w_uv, acc))  # [B, T, H, dv]
