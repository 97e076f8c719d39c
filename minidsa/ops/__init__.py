"""Public ops: one thin dispatching wrapper per op, its reference beside it in ``<op>.py``.

Every op takes ``backend=`` ("torch", "triton", "auto", or None for the backend in force: see
``use_backend`` / ``set_backend``). The references compute in fp32 (fp64 when given fp64). The
paged ops read the KV cache the way a kernel does (planes [num_blocks, block_size, width], int32
block tables, int32 indices with -1 = padding, never read); the dense ops are what they are tested
against. See docs/design.md §12.
"""

from __future__ import annotations

import torch

from ._checks import acc_dtype, cast
from ._denormals import flush_denormals
from ._dispatch import BACKENDS, TRITON_KERNELS, current_backend, pick, register_custom_ops, set_backend, use_backend
from .activation.reference import situ_glu_backward_ref, situ_glu_ref
from .attention.reference import gather_rows, indices_to_mask, masked_dense_attention, sparse_attention_ref
from .attn_res.reference import attn_res_block_scores, attn_res_merge, attn_res_mix_ref
from .gate.reference import output_gate_ref
from .indexer.reference import index_scores_ref, paged_index_scores_ref, topk_indices_ref
from .kda.reference import (
    causal_conv,
    conv_states_at,
    kda_chunk_ref,
    kda_decode_ref,
    kda_inputs_ref,
    kda_recurrent_ref,
    short_conv_ref,
)
from .kv_store.reference import store_kv_ref
from .linear.reference import linear_ref, linear_sum_ref
from .mla.reference import PREFILL_TILE, decompress_kv, sparse_mla_decode_ref, sparse_mla_prefill_ref
from .moe_experts.reference import expert_mlp_fp8_ref, expert_mlp_mxfp4_ref, mxfp4_to_fp8_ref
from .moe_router.reference import moe_plan_ref, moe_route_ref, route_weights
from .norm.reference import rms_norm_ref
from .paging import gather_positions, paged_slots

__all__ = ["BACKENDS", "TRITON_KERNELS", "REFERENCES", "acc_dtype", "cast", "current_backend", "set_backend",
           "register_custom_ops",
           "use_backend", "index_scores", "paged_index_scores", "topk_indices", "sparse_attention",
           "masked_dense_attention", "indices_to_mask", "gather_rows", "store_kv", "sparse_mla_decode",
           "sparse_mla_prefill", "decompress_kv", "paged_slots", "gather_positions", "PREFILL_TILE",
           "kda_recurrent", "kda_chunk", "attn_res_mix", "attn_res_block_scores", "attn_res_merge",
           "mxfp4_to_fp8", "expert_mlp_fp8", "expert_mlp_mxfp4", "situ_glu", "situ_glu_backward",
           "linear", "linear_sum", "moe_route", "moe_plan", "route_weights", "kda_decode", "kda_step_inputs",
           "kda_inputs", "causal_conv", "conv_states_at", "short_conv", "rms_norm", "output_gate"]

# op name -> its PyTorch reference; a Triton kernel registered under the same name must share its signature.
REFERENCES = {
    "index_scores": index_scores_ref, "paged_index_scores": paged_index_scores_ref,
    "topk_indices": topk_indices_ref, "sparse_attention": sparse_attention_ref, "store_kv": store_kv_ref,
    "sparse_mla_decode": sparse_mla_decode_ref, "sparse_mla_prefill": sparse_mla_prefill_ref,
    "kda_recurrent": kda_recurrent_ref, "kda_chunk": kda_chunk_ref, "attn_res_mix": attn_res_mix_ref,
    "mxfp4_to_fp8": mxfp4_to_fp8_ref, "expert_mlp_fp8": expert_mlp_fp8_ref, "expert_mlp_mxfp4": expert_mlp_mxfp4_ref,
    "situ_glu": situ_glu_ref, "situ_glu_backward": situ_glu_backward_ref, "linear": linear_ref, "linear_sum": linear_sum_ref,
    "moe_route": moe_route_ref, "moe_plan": moe_plan_ref, "kda_decode": kda_decode_ref, "short_conv": short_conv_ref,
    "rms_norm": rms_norm_ref, "output_gate": output_gate_ref, "kda_inputs": kda_inputs_ref,
}


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float, *,
                 backend: str | None = None) -> torch.Tensor:
    """Lightning-indexer scores. q [B,T,H,D], k [B,S,D], w [B,T,H] -> [B,T,S] fp32.

    I[b,t,s] = sum_h w[b,t,h] * ReLU(scale * q[b,t,h] . k[b,s]); no causal masking here.
    """
    return pick("index_scores", backend, index_scores_ref, q, k, w)(q, k, w, scale)


def paged_index_scores(q: torch.Tensor, w: torch.Tensor, key_plane: torch.Tensor,
                       key_scale_plane: torch.Tensor | None, block_table: torch.Tensor,
                       context_lens: torch.Tensor, scale: float, q_pos: torch.Tensor | None = None, *,
                       backend: str | None = None) -> torch.Tensor:
    """``index_scores`` over each sequence's cached keys. q [B,T,H,D], w [B,T,H], key_plane [NB,bs,D]
    (+ key_scale_plane [NB,bs,1] or None), block_table int32 [B,MB], context_lens int32 [B], optional q_pos
    int [B,T] -> [B,T,MB*bs] fp32, -inf at positions >= context_lens[b] and after q_pos[b,t]."""
    return pick("paged_index_scores", backend, paged_index_scores_ref, q, key_plane)(
        q, w, key_plane, key_scale_plane, block_table, context_lens, scale, q_pos)


def topk_indices(scores: torch.Tensor, topk: int, q_pos: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Causal top-k. scores [B,T,S], q_pos [B,T] -> int32 [B,T,topk].

    Candidates are positions <= q_pos; sorted by descending score, ties -> lower position; rows
    with fewer than topk candidates are padded with -1 at the end.
    """
    return pick("topk_indices", backend, topk_indices_ref, scores)(scores, topk, q_pos)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float,
                     *, backend: str | None = None) -> torch.Tensor:
    """Attention over selected keys only (dense tensors). q [B,T,H,Dk], k [B,S,Hkv,Dk], v [B,S,Hkv,Dv],
    indices [B,T,K] (-1 = padding), Hkv in {1, H} -> [B,T,H,Dv] fp32.

    Equals ``masked_dense_attention(q, k, v, indices_to_mask(indices, S), scale)``.
    """
    return pick("sparse_attention", backend, sparse_attention_ref, q, k, v)(q, k, v, indices, scale)


def store_kv(plane: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor, *,
             backend: str | None = None) -> None:
    """In place: plane [NB,bs,W] (viewed as [NB*bs, W]) gets values [N,W] at slot_mapping [N]; -1 is skipped."""
    return pick("store_kv", backend, store_kv_ref, plane)(plane, slot_mapping, values)


def sparse_mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_latent_plane: torch.Tensor,
                      k_pe_plane: torch.Tensor, block_table: torch.Tensor, indices: torch.Tensor, scale: float, *,
                      backend: str | None = None) -> torch.Tensor:
    """Absorbed sparse MLA over the paged latent planes. q_latent [B,T,H,r], q_pe [B,T,H,dr],
    planes [NB,bs,r] / [NB,bs,dr], block_table int32 [B,MB], indices int32 [B,T,K] -> o_latent [B,T,H,r] fp32."""
    return pick("sparse_mla_decode", backend, sparse_mla_decode_ref, q_latent, kv_latent_plane)(
        q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices, scale)


def sparse_mla_prefill(q: torch.Tensor, kv_latent_plane: torch.Tensor, k_pe_plane: torch.Tensor,
                       block_table: torch.Tensor, indices: torch.Tensor, kv_b_weight: torch.Tensor, scale: float, *,
                       backend: str | None = None) -> torch.Tensor:
    """Block-aggregated sparse MLA over the paged planes, decompressed with kv_b_weight [H*(dn+dv), r].
    q [B,T,H,dn+dr], block_table int32 [B,MB], indices int32 [B,T,K] -> [B,T,H,dv] fp32."""
    return pick("sparse_mla_prefill", backend, sparse_mla_prefill_ref, q, kv_latent_plane)(
        q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float | None = None, initial_state: torch.Tensor | None = None, *,
                  backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention, one step at a time. q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] log-decay;
    beta [B,T,HV]; initial_state [B,HV,K,V] -> (o [B,T,HV,V] in v.dtype, final_state [B,HV,K,V] fp32)."""
    fn = pick("kda_recurrent", backend, kda_recurrent_ref, q, k, v, g, beta, initial_state)
    with flush_denormals(q):  # exp of long decays: subnormal products, slow on a CPU
        return fn(q, k, v, g, beta, scale, initial_state)


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, chunk_size: int = 64,
              state_at: torch.Tensor | None = None, lengths: torch.Tensor | None = None, *,
              backend: str | None = None) -> tuple[torch.Tensor, ...]:
    """Chunked (WY/UT) form of ``kda_recurrent`` with the same inputs and outputs; T need not be a
    multiple of ``chunk_size``. With ``state_at`` int [M, 2] of (row, position) pairs (positions multiples
    of ``chunk_size``, or T; row -1 skips a pair) a third result holds those rows' states after that many
    tokens, [M, HV, K, V] fp32: a prefix cache keeps them without cutting the prefill there. ``lengths``
    int [B]: each row's real tokens in a padded batch; the padding leaves the state alone, gets o = 0, and
    its whole chunks cost nothing."""
    fn = pick("kda_chunk", backend, kda_chunk_ref, q, k, v, g, beta, initial_state)
    with flush_denormals(q):  # exp of a chunk's cumulative decay: subnormal products, slow on a CPU
        o, state, kept = fn(q, k, v, g, beta, scale, initial_state, chunk_size, state_at, lengths)
    return (o, state) if state_at is None else (o, state, kept)


def kda_decode(projected: torch.Tensor, f_a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
               w_fb: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
               conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, scale: float | None = None, *,
               backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KDA decode step from the layer's projections: projected [B,3HK] (q, k, v before the short convs),
    f_a [B,R] decay down projection, b [B,H] beta logits, conv_weight [3HK,1,W], w_fb [HK,R], A_log, dt_bias,
    conv_pool [S,W-1,3HK] and state_pool [S,H,K,K] read at slots [B] -> (o [B,H,K], new recurrent states
    [B,H,K,K], new conv states [B,W-1,3HK]), fp32. See ops/kda/reference.py."""
    fn = pick("kda_decode", backend, kda_decode_ref, projected, f_a, conv_weight, w_fb, state_pool)
    return fn(projected, f_a, b, conv_weight, w_fb, A_log, dt_bias, lower_bound, conv_pool, state_pool, slots, scale)


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, lengths: torch.Tensor | None = None, *,
               backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's short conv and its SiLU over a (padded) rectangle: x [B,T,C], weight [C,1,W], state [B,W-1,C],
    lengths int [B] or None -> (SiLU(conv) [B,T,C], the state at each row's end [B,W-1,C]), fp32."""
    return pick("short_conv", backend, short_conv_ref, x, weight)(x, weight, state, lengths)


def attn_res_mix(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5,
                 return_weights: bool = False, *, backend: str | None = None):
    """Attention Residual mixer. sources [N,...,D], query [D], norm_weight [D] -> [...,D]
    (and the depth weights [N,...] with ``return_weights``)."""
    # asked for the weights always: one result type, as a custom op's schema needs (they cost N floats a row)
    out = pick("attn_res_mix", backend, attn_res_mix_ref, sources)(sources, query, norm_weight, eps, True)
    return out if return_weights else out[0]


def mxfp4_to_fp8(packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor, out_elements: torch.Tensor,
                 out_scales: torch.Tensor, *, backend: str | None = None) -> None:
    """In place: experts [n] of packed [E,M,P] / scales [E,M,P/16] (MXFP4) into workspace slots 0..n-1 of
    out_elements float8_e4m3fn [cap,M,2P] / out_scales [cap,M,P/16]; bit-exact."""
    return pick("mxfp4_to_fp8", backend, mxfp4_to_fp8_ref, packed)(packed, scales, experts, out_elements, out_scales)


def expert_mlp_fp8(z: torch.Tensor, elements: torch.Tensor, scales: torch.Tensor, gates: torch.Tensor,
                   beta_gate: float, beta_up: float, max_pairs: int = 0, *, backend: str | None = None) -> torch.Tensor:
    """Routed-expert MLPs over FP8 workspace slots. z [N,L], elements [cap,3,I*L], scales [cap,3,I*L/32],
    gates [m,N] (0 = not routed) -> y_lat [N,L] fp32. ``max_pairs``: at least the number of nonzero gates
    (N * top_k for a MoE layer), so a kernel sizes its buffers without reading the count back; 0 = count."""
    return pick("expert_mlp_fp8", backend, expert_mlp_fp8_ref, z, gates)(z, elements, scales, gates, beta_gate,
                                                                          beta_up, max_pairs)


def expert_mlp_mxfp4(z: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                     gates: torch.Tensor, beta_gate: float, beta_up: float, *,
                     backend: str | None = None) -> torch.Tensor:
    """``expert_mlp_fp8`` reading experts [m] straight from MXFP4 packed [E,3,I*L/2] / scales [E,3,I*L/32]."""
    return pick("expert_mlp_mxfp4", backend, expert_mlp_mxfp4_ref, z, gates)(
        z, packed, scales, experts, gates, beta_gate, beta_up)


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta_gate: float, beta_up: float, dtype: torch.dtype | None = None, *,
             backend: str | None = None) -> torch.Tensor:
    """SiTU-GLU, elementwise: g, u [...] -> h [...] fp32, or rounded to ``dtype`` (see ``minidsa.ffn.situ_glu``)."""
    return pick("situ_glu", backend, situ_glu_ref, g, u)(g, u, beta_gate, beta_up, dtype)


def situ_glu_backward(g: torch.Tensor, u: torch.Tensor, grad: torch.Tensor, beta_gate: float, beta_up: float, *,
                      backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Its derivative: g, u, dLoss/dh [...] -> (dLoss/dg, dLoss/du) fp32, recomputed from g and u."""
    return pick("situ_glu_backward", backend, situ_glu_backward_ref, g, u, grad)(g, u, grad, beta_gate, beta_up)


def linear(x: torch.Tensor, weight: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """A bias-free projection: x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype (= weight's)."""
    return pick("linear", backend, linear_ref, x, weight)(x, weight)


def linear_sum(x1: torch.Tensor, w1: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor, *,
               backend: str | None = None) -> torch.Tensor:
    """x1 [..., K1] @ w1 [N, K1]^T + x2 [..., K2] @ w2 [N, K2]^T -> [..., N] (two projections of different inputs
    whose outputs are added: one launch for a decode row). See ops/linear/reference.py."""
    return pick("linear_sum", backend, linear_sum_ref, x1, w1, x2, w2)(x1, w1, x2, w2)


def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, *,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice: logits [N, E], selection bias [E] -> (expert ids int64 [N, top_k], weights fp32
    [N, top_k]); ids by descending sigmoid(logits) + bias, ties -> lower id, weights from sigmoid alone."""
    return pick("moe_route", backend, moe_route_ref, logits)(logits, bias, top_k, scaling)


def moe_plan(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, *,
             backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed experts as the slots of one expert batch: ids, weights [N, top_k] -> (experts int64 [m],
    gates fp32 [m, N], number routed int64 []), m = min(N * top_k, E). See ops/moe_router/reference.py."""
    return pick("moe_plan", backend, moe_plan_ref, ids, weights)(ids, weights, num_experts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None, *,
             backend: str | None = None) -> torch.Tensor:
    """RMSNorm: x [..., D], weight [D] -> x / sqrt(mean(x^2) + eps) * weight [..., D] in x's dtype, computed
    in fp32 (fp64 kept); with ``dtype``, of x cast to it, in it. See ops/norm/reference.py."""
    return pick("rms_norm", backend, rms_norm_ref, x, weight)(x, weight, eps, dtype)


def output_gate(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float, dtype: torch.dtype, *,
                backend: str | None = None) -> torch.Tensor:
    """An attention layer's output gate: o [..., H, K], gate [..., H*K], weight [K] (KDA's per-head RMSNorm) or
    None (MLA) -> norm(o) * sigmoid(gate) [..., H*K] in ``dtype``. See ops/gate/reference.py."""
    return pick("output_gate", backend, output_gate_ref, o, gate, *([] if weight is None else [weight]))(
        o, gate, weight, eps, dtype)


def kda_step_inputs(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    lower_bound: float, *, backend: str | None = None):
    """KDA's per-token inputs from the short convs' SiLU outputs: qkv [..., 3, H, K], z [..., H*K] (W_fb W_fa x),
    b [..., H] -> (q, k (L2-normalised per head), v [..., H, K], g [..., H, K] (log-decay), beta [..., H]) in
    the accumulation dtype; v is qkv's view. The op is ``kda_inputs`` (ops/kda/reference.py)."""
    q, k, g, beta = kda_inputs(qkv, z, b, A_log, dt_bias, lower_bound, backend=backend)
    return q, k, qkv[..., 2, :, :], g, beta


def kda_inputs(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               lower_bound: float, *, backend: str | None = None):
    """``kda_step_inputs`` without v, as one op: (q, k, g [..., H, K], beta [..., H]). See ops/kda/reference.py."""
    return pick("kda_inputs", backend, kda_inputs_ref, qkv, z, b)(qkv, z, b, A_log, dt_bias, lower_bound)
