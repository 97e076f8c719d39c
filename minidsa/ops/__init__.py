"""Public ops. Each takes ``backend="torch" | "triton" | "auto"`` (default "auto").

The references (fp32 math, shape docstrings) live beside this file; Triton kernels register
themselves in ``_dispatch.TRITON_KERNELS`` under the same names and signatures.
"""

from __future__ import annotations

import torch

from ._checks import acc_dtype
from ._dispatch import BACKENDS, pick
from .attention import gather_rows, indices_to_mask, masked_dense_attention, sparse_attention_ref
from .attn_res import attn_res_block_scores, attn_res_merge, attn_res_mix_ref
from .indexer import index_scores_ref, topk_indices_ref
from .kda import kda_chunk_ref, kda_recurrent_ref

__all__ = ["BACKENDS", "acc_dtype", "index_scores", "topk_indices", "sparse_attention", "masked_dense_attention",
           "indices_to_mask", "gather_rows", "kda_recurrent", "kda_chunk", "attn_res_mix",
           "attn_res_block_scores", "attn_res_merge"]


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float, *,
                 backend: str = "auto") -> torch.Tensor:
    """Lightning-indexer scores. q [B,T,H,D], k [B,S,D], w [B,T,H] -> [B,T,S] fp32.

    I[b,t,s] = sum_h w[b,t,h] * ReLU(scale * q[b,t,h] . k[b,s]); no causal masking here.
    """
    return pick("index_scores", backend, index_scores_ref, q, k, w)(q, k, w, scale)


def topk_indices(scores: torch.Tensor, topk: int, q_pos: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Causal top-k. scores [B,T,S], q_pos [B,T] -> int32 [B,T,topk].

    Candidates are positions <= q_pos; sorted by descending score, ties -> lower position; rows
    with fewer than topk candidates are padded with -1 at the end.
    """
    return pick("topk_indices", backend, topk_indices_ref, scores)(scores, topk, q_pos)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float,
                     *, backend: str = "auto") -> torch.Tensor:
    """Attention over selected keys only. q [B,T,H,Dk], k [B,S,Hkv,Dk], v [B,S,Hkv,Dv],
    indices [B,T,K] (-1 = padding), Hkv in {1, H} -> [B,T,H,Dv] fp32.

    Equals ``masked_dense_attention(q, k, v, indices_to_mask(indices, S), scale)``.
    """
    return pick("sparse_attention", backend, sparse_attention_ref, q, k, v)(q, k, v, indices, scale)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float | None = None, initial_state: torch.Tensor | None = None, *,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention, one step at a time. q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] log-decay;
    beta [B,T,HV]; initial_state [B,HV,K,V] -> (o [B,T,HV,V] in v.dtype, final_state [B,HV,K,V] fp32)."""
    return pick("kda_recurrent", backend, kda_recurrent_ref, q, k, v)(q, k, v, g, beta, scale, initial_state)


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, chunk_size: int = 64, *,
              backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY/UT) form of ``kda_recurrent`` with the same inputs and outputs; T need not be a
    multiple of ``chunk_size``."""
    return pick("kda_chunk", backend, kda_chunk_ref, q, k, v)(q, k, v, g, beta, scale, initial_state, chunk_size)


def attn_res_mix(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5,
                 return_weights: bool = False, *, backend: str = "auto"):
    """Attention Residual mixer. sources [N,...,D], query [D], norm_weight [D] -> [...,D]
    (and the depth weights [N,...] with ``return_weights``)."""
    return pick("attn_res_mix", backend, attn_res_mix_ref, sources)(sources, query, norm_weight, eps, return_weights)
