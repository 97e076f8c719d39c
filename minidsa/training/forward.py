"""The lean training forward: the same function as the no-cache reference ``MiniDSA.forward``, built for
forward + backward at batch x context (docs/design.md §2).

The reference stays the definition; this path reuses every layer's own projections and differs only in
how the expensive parts are computed (lean_ops.py):
  * MLA: the indexer's top-k becomes a boolean key mask and attention is one SDPA call with it, instead
    of gathering K keys per query;
  * KDA: the chunked form with matmul-only intra-chunk terms and one batched triangular solve;
  * MoE: routed experts from float master weights (``MasterExperts``, the weights training updates),
    tokens grouped by expert; they are quantised to MXFP4 only when a checkpoint is saved.

    tm = TrainingModel(model)                     # master experts = the model's MXFP4 experts, dequantised
    logits, inputs = tm(input_ids, selection="indexer", record=True)
    tm.export_experts()                            # masters -> MXFP4 in the model, then model.save_pretrained
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..formats import mxfp4
from ..model.decoder import DecoderLayer, mix_sources
from ..model.experts import EXPERT_WEIGHTS
from ..model.kda import KimiDeltaAttention
from ..model.minidsa import MiniDSA
from ..model.mla import GatedMLA
from ..model.moe import LatentMoE
from ..ops import acc_dtype
from .lean_ops import grouped_experts, kda_chunk_train, selection_mask, train_chunk_size

SELECTIONS = ("indexer", "dense", "random")  # which keys the MLA layers attend to


class MasterExperts(nn.Module):
    """Float master copy of one MoE layer's routed experts: w1, w3 [E, I, L] and w2 [E, L, I]."""

    def __init__(self, moe: LatentMoE, dtype: torch.dtype) -> None:
        super().__init__()
        for name in EXPERT_WEIGHTS:  # MXFP4 values are exact in fp32, so the copy starts equal to the model
            self.register_parameter(name, nn.Parameter(mxfp4.dequantize(*moe.experts.matrix(name), dtype)))

    @torch.no_grad()
    def export(self, moe: LatentMoE) -> None:
        """Quantise the masters to MXFP4 into ``moe``'s packed buffers (what save_pretrained writes)."""
        for name in EXPERT_WEIGHTS:
            packed, scales = mxfp4.quantize(getattr(self, name).float().cpu())
            codes, e8m0 = moe.experts.matrix(name)
            codes.copy_(packed.to(codes.device))
            e8m0.copy_(scales.to(e8m0.device))
        moe.experts.refresh_offline()


class TrainingModel(nn.Module):
    """A MiniDSA plus the master experts of its MoE layers: ``parameters()`` is everything training updates."""

    def __init__(self, model: MiniDSA) -> None:
        super().__init__()
        if not isinstance(model, MiniDSA):
            raise TypeError(f"TrainingModel wraps a minidsa.MiniDSA, got {type(model).__name__}")
        self.model = model
        model.materialize_experts()  # a lazily loaded model reads its experts first
        dtype = acc_dtype(model.language_model.lm_head.weight)
        self.experts = nn.ModuleList(MasterExperts(m, dtype) for m in model.moe_layers())
        kc = model.config.kda
        self.kda_chunk = train_chunk_size(kc.decay_lower_bound, kc.chunk_size)

    def export_experts(self) -> None:
        """Write the master experts, quantised to MXFP4, into the model (before ``model.save_pretrained``)."""
        for masters, moe in zip(self.experts, self.model.moe_layers()):
            masters.export(moe)

    def forward(self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None,
                selection: str = "indexer", record: bool = False, generator: torch.Generator | None = None):
        """input_ids [B, T] (or inputs_embeds [B, T, d]) -> (logits fp32 [B, T, vocab], {GatedMLA: its
        normalised input x [B, T, d]} when ``record`` else {}). ``selection``: "indexer" (the model's own
        top-k, equal to the reference forward), "dense" (every causal key) or "random" (``generator``)."""
        if selection not in SELECTIONS:
            raise ValueError(f"selection = {selection!r}; use one of {SELECTIONS}")
        h = self.model._input_embeddings(input_ids, inputs_embeds)
        if h.shape[1] > self.model.config.max_seq_len:
            raise ValueError(f"input has {h.shape[1]} tokens, more than max_seq_len = {self.model.config.max_seq_len}")
        recorded: dict[GatedMLA, torch.Tensor] = {}
        decoder = self.model.language_model.model
        acc = acc_dtype(h)
        blocks: list[torch.Tensor] = []
        partial = h.to(acc)
        experts = iter(self.experts)
        for l, layer in enumerate(decoder.layers):  # the Block AttnRes wiring of TextDecoder.forward
            x = layer.mix_attn(blocks + [partial], None) if blocks else partial
            a = self._attention(layer, x, selection, recorded if record else None, generator).to(acc)
            if l % decoder.layers_per_block == 0:
                blocks.append(partial)
                partial = a
            else:
                partial = partial + a
            x = layer.post_attention_layernorm(layer.mix_ffn(blocks + [partial], None).to(layer.compute_dtype))
            ffn = moe_forward(layer.block_sparse_moe, next(experts), x) if layer.is_moe else layer.mlp(x)
            partial = partial + ffn.to(acc)
        out = mix_sources(blocks + [partial], decoder.output_attn_res_norm, decoder.output_attn_res_proj, "out", None)
        logits = self.model.language_model.lm_head(decoder.norm(out.to(decoder.compute_dtype)))
        return (logits if logits.dtype == torch.float64 else logits.float()), recorded

    def _attention(self, layer: DecoderLayer, h: torch.Tensor, selection: str, recorded, generator) -> torch.Tensor:
        x = layer.input_layernorm(h.to(layer.compute_dtype))
        if isinstance(layer.self_attn, KimiDeltaAttention):
            return kda_forward(layer.self_attn, x, self.kda_chunk)
        if recorded is not None:
            recorded[layer.self_attn] = x
        return mla_forward(layer.self_attn, x, selection, generator)


def mla_forward(mla: GatedMLA, x: torch.Tensor, selection: str, generator: torch.Generator | None) -> torch.Tensor:
    """x [B, T, d] -> [B, T, d]: the layer's projections, the selection as a key mask, one masked SDPA."""
    B, T, _ = x.shape
    p = mla._project(x)
    with torch.no_grad():  # top-k is not differentiable: the indexer learns from its KL loss alone
        scores = indexer_scores(mla, p) if selection == "indexer" else None
        keep = selection_mask(scores, mla.indexer.topk, T, x.device, selection, generator, B)
    k, v = mla.decompress(p["kv_latent"], p["k_pe"])
    acc = acc_dtype(p["q"])
    o = F.scaled_dot_product_attention(p["q"].to(acc).transpose(1, 2), k.to(acc).transpose(1, 2),
                                       v.to(acc).transpose(1, 2), attn_mask=keep.unsqueeze(1),
                                       scale=mla.softmax_scale)  # every row keeps at least one key
    return mla._finish(o.transpose(1, 2), p["gate"])


def indexer_scores(mla: GatedMLA, proj: dict) -> torch.Tensor:
    """Indexer scores [B, T, T] of the projected tokens (no causal mask; top-k applies it)."""
    return ops.index_scores(proj["q_idx"], mla.indexer.dequant_keys(proj), proj["w_idx"], mla.indexer.softmax_scale)


def kda_forward(kda: KimiDeltaAttention, x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """x [B, T, d] -> [B, T, d] from a zero state (conv and recurrent), the recurrence by kda_chunk_train."""
    B = x.shape[0]
    zeros = {n: torch.zeros((B,) + s, dtype=acc_dtype(x), device=x.device) for n, s in kda.state_shapes().items()}
    (q, k, v, g, beta), _, gate = kda.inputs_and_gate(x, zeros)
    return kda.output(kda_chunk_train(q, k, v, g, beta, chunk_size).to(v.dtype), x, gate)


def moe_forward(moe: LatentMoE, masters: MasterExperts, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, d] -> [B, T, d]: LatentMoE.forward with the routed experts computed from the float masters."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    ids, weights, z, gate, up = moe.project(x)
    store = moe.experts
    y_lat = grouped_experts(z.to(acc_dtype(x)), ids, weights, masters.w1, masters.w3, masters.w2, store.beta_gate,
                            store.beta_up)
    return moe.combine(y_lat, gate, up, x.dtype).reshape(shape)
