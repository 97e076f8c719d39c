"""The DSA lightning indexer module: cheap scores over every past token, then top-k (docs/design.md §2).

q_I = W_qI c_q        -> [H_I, D_I] per token (reads the MLA's compressed query)
k_I = LayerNorm(W_kI x) -> [D_I] per token, one key shared by all indexer heads (this is cached)
w   = W_w x * H_I^-0.5  -> one signed weight per indexer head (W_w kept in fp32)
I[t, s] = sum_h w[t, h] * ReLU(D_I^-0.5 * q_I[t, h] . k_I[s])

With ``fp8`` numerics q_I and k_I are rounded through float8_e4m3fn with a power-of-two scale per
vector (after the Hadamard rotation, applied to both, when ``hadamard`` is on); the cache then stores
the e4m3 key plus its fp32 scale, exactly what the no-cache path computes, so both paths agree.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..cache import CacheContext, Plane
from ..config import ModelConfig
from ..formats.fp8 import dequantize_fp8, hadamard, hadamard_matrix, quantize_fp8_pow2
from ..ops import acc_dtype


class LightningIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        ic = cfg.indexer
        self.num_heads, self.head_dim, self.topk = ic.num_heads, ic.head_dim, ic.topk
        self.fp8, self.use_hadamard = ic.fp8, ic.hadamard
        self.wq_b = nn.Linear(cfg.mla.q_lora_rank, ic.num_heads * ic.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, ic.head_dim, bias=False)
        # LayerNorm with bias; its eps is the model's rms_norm_eps (1e-5 in K3.1), not DeepSeek-V3.2's 1e-6
        self.k_norm = nn.LayerNorm(ic.head_dim, eps=cfg.rms_norm_eps)
        self.weights_proj = nn.Linear(cfg.hidden_size, ic.num_heads, bias=False)
        self.softmax_scale = ic.head_dim ** -0.5
        # The rotation's matrix, a constant: not in the checkpoint, rebuilt wherever the module moves
        self.register_buffer("rotation", hadamard_matrix(ic.head_dim) if ic.hadamard else None, persistent=False)

    def _apply(self, fn, recurse=True):  # to_empty (checkpoint loading) leaves buffers uninitialised
        out = super()._apply(fn, recurse)
        if self.rotation is not None:
            self.rotation = hadamard_matrix(self.head_dim).to(self.rotation.device)
        return out

    @staticmethod
    def cache_planes(cfg: ModelConfig, dtype: torch.dtype) -> tuple[Plane, ...]:
        """The cached form of k_I: e4m3 values plus one fp32 scale per token with fp8 numerics."""
        if cfg.indexer.fp8:
            return (Plane("index_key", cfg.indexer.head_dim, torch.float8_e4m3fn), Plane("index_key_scale", 1, torch.float32))
        return (Plane("index_key", cfg.indexer.head_dim, dtype),)

    def _numerics(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotation + fp8 round trip of the deployment numerics; identity (no scale) otherwise."""
        if self.use_hadamard:
            x = hadamard(x, self.rotation)
        if not self.fp8:
            return x, None
        return quantize_fp8_pow2(x)

    def keys(self, x_hat: torch.Tensor) -> dict[str, torch.Tensor]:
        """x_hat [B, T, d] -> the cache planes of k_I: {"index_key": [B, T, D_I]} plus
        {"index_key_scale": [B, T, 1]} with fp8 numerics."""
        return self.key_planes(self.wk(x_hat))

    def key_planes(self, k: torch.Tensor) -> dict[str, torch.Tensor]:
        """The projected key W_kI x [B, T, D_I] -> its cache planes (``keys`` after the projection)."""
        acc = acc_dtype(k)
        # LayerNorm in fp32 with its fp32 weight and bias, whatever the model dtype
        k = nn.functional.layer_norm(k.to(acc), (self.head_dim,), self.k_norm.weight.to(acc),
                                     self.k_norm.bias.to(acc), self.k_norm.eps)
        k, scale = self._numerics(k)
        planes = {"index_key": k}
        if scale is not None:
            planes["index_key_scale"] = scale
        return planes

    def dequant_keys(self, planes: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of the storage form: planes -> k_I [..., D_I] in compute precision."""
        if "index_key_scale" in planes:
            return dequantize_fp8(planes["index_key"], planes["index_key_scale"])
        return planes["index_key"]

    def queries(self, c_q: torch.Tensor, x_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_q [B, T, q_lora], x_hat [B, T, d] -> (q_I [B, T, H_I, D_I], w [B, T, H_I])."""
        acc = acc_dtype(x_hat)
        w = nn.functional.linear(x_hat.to(acc), self.weights_proj.weight.to(acc))
        return self.head_queries(self.wq_b(c_q)), self.head_weights(w)

    def head_queries(self, q: torch.Tensor) -> torch.Tensor:
        """W_qI c_q [B, T, H_I * D_I] -> q_I [B, T, H_I, D_I] in the deployment numerics."""
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        q, scale = self._numerics(q)
        if scale is None:
            return q
        q = dequantize_fp8(q, scale)
        # An e4m3 value times a power of two is exact in bf16, so bf16 holds the same q: the score kernel then
        # runs its dots on the tensor cores, where fp32 operands would take the FMA units (the same products,
        # summed in fp32 either way). Under autograd q stays fp32, so that its gradient is not rounded.
        return q if torch.is_grad_enabled() else q.to(torch.bfloat16)

    def head_weights(self, w: torch.Tensor) -> torch.Tensor:
        """W_w x [B, T, H_I] (fp32) -> the head weights w, scaled by H_I^-0.5."""
        return w * self.num_heads ** -0.5

    def select(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """q [B,T,H_I,D_I], w [B,T,H_I], k [B,S,D_I] (positions 0..S-1), q_pos [B,T] -> int32 [B,T,topk]."""
        scores = ops.index_scores(q, k, w, self.softmax_scale)
        return ops.topk_indices(scores, self.topk, q_pos)

    def select_paged(self, q: torch.Tensor, w: torch.Tensor, planes: dict[str, torch.Tensor],
                     ctx: CacheContext) -> torch.Tensor:
        """The same selection over the paged key planes of one layer ([num_blocks, block_size, D_I] and,
        with fp8 numerics, the [.., 1] scales): q [B,T,H_I,D_I], w [B,T,H_I] -> int32 [B,T,topk]."""
        scores = ops.paged_index_scores(q, w, planes["index_key"], planes.get("index_key_scale"), ctx.block_table,
                                        ctx.context_lens, self.softmax_scale, ctx.positions)
        return ops.topk_indices(scores, self.topk, ctx.positions)
