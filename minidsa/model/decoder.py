"""The decoder stack: layers (KDA or MLA+DSA attention, dense or MoE FFN) wired by Block Attention
Residuals (docs/design.md §1), and the cache layout those layers need.

Each layer has two sub-layers and two residual mixers; the decoder keeps the stored block
representations (the embedding is block 0) and the running sum of the current block, and feeds each
sub-layer a softmax mix over depth. ``MiniDSA`` (minidsa.py) wraps this with the embedding inputs,
the caches, the experts and the vision path.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..cache import CacheContext, CacheLayout
from ..config import ModelConfig
from ..ops import acc_dtype, cast
from .ffn import SituGluMLP
from .kda import KimiDeltaAttention
from .mla import GatedMLA
from .moe import LatentMoE
from .norm import RMSNorm
from .trace import ForwardTrace, token_pieces


def mix_sources(sources: torch.Tensor | list[torch.Tensor], norm: RMSNorm, proj: nn.Linear, name: str,
                trace: ForwardTrace | None) -> torch.Tensor:
    """One Block-AttnRes mixer: N sources [B, T, d] (a list, or stacked [N, B, T, d]) -> [B, T, d] (fp32/fp64).
    ``proj.weight`` [1, d] is the pseudo-query w (zero at init), ``norm.weight`` the RMSNorm gamma of the scores."""
    stacked = torch.stack(sources) if isinstance(sources, list) else sources
    out, alpha = ops.attn_res_mix(stacked, proj.weight[0], norm.weight, norm.eps, return_weights=True)
    if trace is not None:
        trace.depth_weights[name] = alpha
    return out


def _add_to(sources: torch.Tensor, n: int, x: torch.Tensor) -> torch.Tensor:
    """sources[n] += x [B, T, d] (upcast). In place, unless autograd records: a mixer's backward needs the
    sources it read as they were. (``sources[n] += x`` would add, then copy the sum onto itself: Python
    assigns an augmented item back, one more kernel per sub-layer.)"""
    if torch.is_grad_enabled():
        return sources.index_add(0, torch.tensor([n], device=sources.device), cast(x, sources.dtype).unsqueeze(0))
    sources[n].add_(x)
    return sources


class DecoderLayer(nn.Module):
    """One layer = attention sub-layer (KDA or MLA+DSA) + FFN sub-layer, each with its AttnRes mixer.
    The residual wiring lives in the decoder loop (Block AttnRes, docs/design.md §1)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, cache_layer: int, workspace) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        if self.layer_type == "mla":
            self.self_attn = GatedMLA(cfg, layer_idx, cache_layer)
        else:
            self.self_attn = KimiDeltaAttention(cfg, layer_idx, cache_layer)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.is_moe = layer_idx >= cfg.moe.first_dense_layers
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg, workspace)
        else:
            self.mlp = SituGluMLP(d, cfg.dense_intermediate_size, cfg.activation_beta_gate, cfg.activation_beta_up)
        # The two AttnRes mixers, named as in the checkpoint: {self_attention_res,mlp_res}_{norm,proj}.
        self.self_attention_res_norm = RMSNorm(d, eps)
        self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
        self.mlp_res_norm = RMSNorm(d, eps)
        self.mlp_res_proj = nn.Linear(d, 1, bias=False)
        self.compute_dtype = cfg.torch_dtype  # sub-layers run in the model dtype; the residual mix in fp32

    def mix_attn(self, sources: list[torch.Tensor], trace: ForwardTrace | None) -> torch.Tensor:
        return mix_sources(sources, self.self_attention_res_norm, self.self_attention_res_proj,
                           f"{self.layer_idx}.attn", trace)

    def mix_ffn(self, sources: list[torch.Tensor], trace: ForwardTrace | None) -> torch.Tensor:
        return mix_sources(sources, self.mlp_res_norm, self.mlp_res_proj, f"{self.layer_idx}.ffn", trace)

    def attention(self, h: torch.Tensor, ctx: CacheContext | None, trace: ForwardTrace | None) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(h, self.compute_dtype), ctx, trace)

    def feed_forward(self, h: torch.Tensor, trace: ForwardTrace | None = None) -> torch.Tensor:
        h = self.post_attention_layernorm(h, self.compute_dtype)
        return self.block_sparse_moe(h, trace) if self.is_moe else self.mlp(h)


class TextDecoder(nn.Module):
    """``language_model.model``: embedding, layers wired by Block Attention Residuals, final norm."""

    def __init__(self, cfg: ModelConfig, workspace) -> None:
        super().__init__()
        self.config = cfg
        self.layers_per_block = cfg.attn_res_block_size  # AttnRes block: layers, not tokens
        self.two_phase = cfg.attn_res_two_phase
        self.eps = cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rank = {i: r for r, i in enumerate(cfg.mla_layers)} | {i: r for r, i in enumerate(cfg.kda_layers)}
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rank[i], workspace) for i in range(cfg.num_layers))
        # the output mixer, named as in the checkpoint
        self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.compute_dtype = cfg.torch_dtype

    def forward(self, emb: torch.Tensor, ctx: CacheContext | None, trace: ForwardTrace | None) -> torch.Tensor:
        """emb [B, T, d] -> final hidden states [B, T, d] (after the output mixer and the final norm).

        The sources of the mixers live in one buffer [blocks + 1, B, T, d]: the completed block representations
        (the embedding is block 0), then the running sum of the current block's sub-layer outputs. A mixer
        reads a prefix of the buffer as it is: nothing is stacked per mixer.
        """
        acc = acc_dtype(emb)
        if trace is not None:  # the token axis by sequence: the choices a trace holds are kept per sequence
            trace.pieces = token_pieces(ctx, *emb.shape[:2])
        if self.two_phase:
            return self._forward_two_phase(cast(emb, acc), ctx, trace)
        sources = _add_to(emb.new_zeros((-(-len(self.layers) // self.layers_per_block) + 1, *emb.shape), dtype=acc),
                          0, emb)
        n = 0  # completed blocks; sources[n] is the running sum
        for l, layer in enumerate(self.layers):
            h = layer.mix_attn(sources[: n + 1], trace) if n else sources[0]
            n += l % self.layers_per_block == 0  # a new block starts: the finished one stays stored
            sources = _add_to(sources, n, layer.attention(h, ctx, trace))
            sources = _add_to(sources, n, layer.feed_forward(layer.mix_ffn(sources[: n + 1], trace), trace))
        out = mix_sources(sources[: n + 1], self.output_attn_res_norm, self.output_attn_res_proj, "out", trace)
        return self.norm(out, self.compute_dtype)

    def _forward_two_phase(self, partial: torch.Tensor, ctx, trace) -> torch.Tensor:
        """The same function as ``forward``, scheduled as in the AttnRes paper's inference: when a block
        starts, score all its mixers against the stored blocks in one batch (phase 1); each mixer then
        only merges its current partial sum by online softmax (phase 2). Exact up to rounding."""
        acc = partial.dtype
        blocks: list[torch.Tensor] = []
        stacked = scores = None  # the stored blocks and their scores, set when each block starts

        def merge(k, part, norm, proj, name):  # phase 2 for mixer k of the current block
            out = ops.attn_res_merge(stacked, scores[k], part, proj.weight[0], norm.weight, self.eps,
                                     return_weights=trace is not None)
            if trace is None:
                return out
            trace.depth_weights[name] = out[1]
            return out[0]

        for l, layer in enumerate(self.layers):
            j = l % self.layers_per_block
            if j == 0:  # the finished block is stored; score this block's mixers at once
                blocks.append(partial)
                stacked = torch.stack(blocks)
                scores = self._block_scores(stacked, self.layers[l: l + self.layers_per_block])
                # the attention mixer's sources are exactly the stored blocks (layer 0: the embedding)
                h = partial if l == 0 else merge(0, None, layer.self_attention_res_norm,
                                                 layer.self_attention_res_proj, f"{l}.attn")
                partial = cast(layer.attention(h, ctx, trace), acc)
            else:
                h = merge(2 * j, partial, layer.self_attention_res_norm, layer.self_attention_res_proj, f"{l}.attn")
                partial = partial + cast(layer.attention(h, ctx, trace), acc)
            h = merge(2 * j + 1, partial, layer.mlp_res_norm, layer.mlp_res_proj, f"{l}.ffn")
            partial = partial + cast(layer.feed_forward(h, trace), acc)
        out = mix_sources(blocks + [partial], self.output_attn_res_norm, self.output_attn_res_proj, "out", trace)
        return self.norm(out, self.compute_dtype)

    def _block_scores(self, stacked: torch.Tensor, group) -> torch.Tensor:
        """Phase 1: the 2 mixers of every layer in ``group`` scored against the stored blocks -> [2*len, N, B, T]."""
        q = torch.stack([w for x in group for w in (x.self_attention_res_proj.weight[0], x.mlp_res_proj.weight[0])])
        g = torch.stack([w for x in group for w in (x.self_attention_res_norm.weight, x.mlp_res_norm.weight)])
        return ops.attn_res_block_scores(stacked, q, g, self.eps)

    def cache_layout(self, num_blocks: int, block_size: int, max_sequences: int, dtype: torch.dtype) -> CacheLayout:
        """What the layers need from a cache: each MLA layer's planes, each KDA layer's state tensors."""
        mla = [layer.self_attn for layer in self.layers if layer.layer_type == "mla"]
        kda = [layer.self_attn for layer in self.layers if layer.layer_type == "kda"]
        states = tuple(kda[0].state_shapes().items()) if kda else ()
        return CacheLayout(mla[0].cache_planes(self.config, dtype), len(mla), block_size, num_blocks, states=states,
                           num_state_layers=len(kda), num_state_slots=max_sequences,
                           state_dtype=acc_dtype(torch.empty((), dtype=dtype)))


class LanguageModel(nn.Module):
    """``language_model``: the decoder and its output head."""

    def __init__(self, cfg: ModelConfig, workspace) -> None:
        super().__init__()
        self.model = TextDecoder(cfg, workspace)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
