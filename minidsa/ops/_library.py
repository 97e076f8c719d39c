"""The Triton kernels as ``torch.library`` custom ops, so that ``torch.compile`` can trace around them.

Dynamo cannot look inside a Triton launcher that builds its grid on the host, reads tensor strides and
picks a variant, and Inductor must not try. Registered as an opaque op ``minidsa::<name>`` with a fake
implementation (output shapes and dtypes from input shapes alone), a kernel becomes one node of the traced
graph: ``torch.compile(fullgraph=True)`` fuses the glue around it and a CUDA graph captures it like any
other launch. Eager calls skip the registered op and call the kernel directly: the dispatcher's few
microseconds per call are pure host cost on a decode step that is already bound by launches.

One schema and one fake per entry of ``TRITON_KERNELS`` (tests/ops/test_library.py checks both against
the kernels). The references are plain PyTorch and are traced as they are.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

NAMESPACE = "minidsa"

# op -> (schema, mutated arguments). Arguments and results are those of the reference (ops/__init__.py).
SCHEMAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "store_kv": ("(Tensor(a!) plane, Tensor slot_mapping, Tensor values) -> ()", ("plane",)),
    "index_scores": ("(Tensor q, Tensor k, Tensor w, float scale) -> Tensor", ()),
    "paged_index_scores": ("(Tensor q, Tensor w, Tensor key_plane, Tensor? key_scale_plane, Tensor block_table, "
                           "Tensor context_lens, float scale, Tensor? q_pos=None) -> Tensor", ()),
    "topk_indices": ("(Tensor scores, int topk, Tensor q_pos) -> Tensor", ()),
    "sparse_mla_decode": ("(Tensor q_latent, Tensor q_pe, Tensor kv_latent_plane, Tensor k_pe_plane, "
                          "Tensor block_table, Tensor indices, float scale) -> Tensor", ()),
    "sparse_mla_prefill": ("(Tensor q, Tensor kv_latent_plane, Tensor k_pe_plane, Tensor block_table, "
                           "Tensor indices, Tensor kv_b_weight, float scale) -> Tensor", ()),
    "kda_recurrent": ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale, "
                      "Tensor? initial_state) -> (Tensor, Tensor)", ()),
    "kda_chunk": ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale, Tensor? initial_state, "
                  "int chunk_size, Tensor? state_at=None, Tensor? lengths=None) -> (Tensor, Tensor, Tensor)", ()),
    "kda_decode": ("(Tensor projected, Tensor f_a, Tensor b, Tensor conv_weight, Tensor w_fb, Tensor A_log, "
                   "Tensor dt_bias, float lower_bound, Tensor conv_pool, Tensor state_pool, Tensor slots, "
                   "float? scale) -> (Tensor, Tensor, Tensor)", ()),
    "mxfp4_to_fp8": ("(Tensor packed, Tensor scales, Tensor experts, Tensor(a!) out_elements, "
                     "Tensor(b!) out_scales) -> ()", ("out_elements", "out_scales")),
    "expert_mlp_fp8": ("(Tensor z, Tensor elements, Tensor scales, Tensor gates, float beta_gate, "
                       "float beta_up, int max_pairs=0) -> Tensor", ()),
    "expert_mlp_mxfp4": ("(Tensor z, Tensor packed, Tensor scales, Tensor experts, Tensor gates, "
                         "float beta_gate, float beta_up) -> Tensor", ()),
    "situ_glu": ("(Tensor g, Tensor u, float beta_gate, float beta_up, ScalarType? dtype=None) -> Tensor", ()),
    "linear": ("(Tensor x, Tensor weight) -> Tensor", ()),
    "linear_sum": ("(Tensor x1, Tensor w1, Tensor x2, Tensor w2) -> Tensor", ()),
    "moe_route": ("(Tensor logits, Tensor bias, int top_k, float scaling) -> (Tensor, Tensor)", ()),
    "moe_plan": ("(Tensor ids, Tensor weights, int num_experts) -> (Tensor, Tensor, Tensor)", ()),
    "situ_glu_backward": ("(Tensor g, Tensor u, Tensor grad, float beta_gate, float beta_up) -> (Tensor, Tensor)",
                          ()),
    # called with return_weights=True by ops.attn_res_mix, so the result is always the pair
    "attn_res_mix": ("(Tensor sources, Tensor query, Tensor norm_weight, float eps=1e-05, bool return_weights=False) "
                     "-> (Tensor, Tensor)", ()),
    "short_conv": ("(Tensor x, Tensor weight, Tensor state, Tensor? lengths=None) -> (Tensor, Tensor)", ()),
    "rms_norm": ("(Tensor x, Tensor weight, float eps, ScalarType? dtype=None) -> Tensor", ()),
    "output_gate": ("(Tensor o, Tensor gate, Tensor? weight, float eps, ScalarType dtype) -> Tensor", ()),
    "kda_inputs": ("(Tensor qkv, Tensor z, Tensor b, Tensor A_log, Tensor dt_bias, float lower_bound) "
                   "-> (Tensor, Tensor, Tensor, Tensor)", ()),
}


def _new(like: torch.Tensor, shape, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty result; by default in the ops' accumulation dtype: fp32, fp64 for fp64 inputs."""
    return like.new_empty(tuple(shape), dtype=dtype or (torch.float64 if like.dtype == torch.float64 else torch.float32))


def _kda(q, k, v, g, beta, scale, initial_state):
    """(o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] in the accumulation dtype)."""
    B, T, HV, V = v.shape
    return _new(v, (B, T, HV, V), v.dtype), _new(v, (B, HV, q.shape[-1], V))


# op -> fake implementation: empty outputs of the kernel's shapes and dtypes (nothing for in-place ops).
FAKES: dict[str, Callable] = {
    "store_kv": lambda plane, slot_mapping, values: None,
    "index_scores": lambda q, k, w, scale: _new(q, (*q.shape[:2], k.shape[1])),
    "paged_index_scores": lambda q, w, key_plane, key_scale_plane, block_table, context_lens, scale, q_pos=None:
        _new(q, (*q.shape[:2], block_table.shape[1] * key_plane.shape[1])),
    "topk_indices": lambda scores, topk, q_pos: _new(scores, (*scores.shape[:2], topk), torch.int32),
    "sparse_mla_decode": lambda q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices, scale:
        _new(q_latent, q_latent.shape),
    "sparse_mla_prefill": lambda q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale:
        _new(q, (*q.shape[:3], kv_b_weight.shape[0] // q.shape[2] - (q.shape[3] - k_pe_plane.shape[-1]))),
    "kda_recurrent": _kda,
    "kda_chunk": lambda q, k, v, g, beta, scale, initial_state, chunk_size, state_at=None, lengths=None: (
        *_kda(q, k, v, g, beta, scale, initial_state),
        _new(v, (0 if state_at is None else state_at.shape[0], v.shape[2], q.shape[-1], v.shape[3]))),
    "kda_decode": lambda projected, f_a, b, conv_weight, w_fb, A_log, dt_bias, lower_bound, conv_pool, state_pool,
                         slots, scale: (_new(projected, (projected.shape[0], *state_pool.shape[1:3])),
                                        _new(projected, (projected.shape[0], *state_pool.shape[1:])),
                                        _new(projected, (projected.shape[0], *conv_pool.shape[1:]))),
    "mxfp4_to_fp8": lambda packed, scales, experts, out_elements, out_scales: None,
    "expert_mlp_fp8": lambda z, elements, scales, gates, beta_gate, beta_up, max_pairs=0: _new(z, z.shape),
    "expert_mlp_mxfp4": lambda z, packed, scales, experts, gates, beta_gate, beta_up: _new(z, z.shape),
    "situ_glu": lambda g, u, beta_gate, beta_up, dtype=None: _new(g, g.shape, dtype),
    "linear": lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])),
    "linear_sum": lambda x1, w1, x2, w2: x1.new_empty((*x1.shape[:-1], w1.shape[0])),
    "moe_route": lambda logits, bias, top_k, scaling: (_new(logits, (logits.shape[0], top_k), torch.int64),
                                                       _new(logits, (logits.shape[0], top_k))),
    "moe_plan": lambda ids, weights, num_experts: (
        _new(ids, (min(ids.numel(), num_experts),), torch.int64),
        _new(weights, (min(ids.numel(), num_experts), ids.shape[0])), _new(ids, (), torch.int64)),
    "situ_glu_backward": lambda g, u, grad, beta_gate, beta_up: (_new(g, g.shape), _new(g, g.shape)),
    "attn_res_mix": lambda sources, query, norm_weight, eps=1e-5, return_weights=False: (
        _new(sources, sources.shape[1:]), _new(sources, sources.shape[:-1])),
    "short_conv": lambda x, weight, state, lengths=None: (_new(x, x.shape), _new(x, state.shape)),
    "rms_norm": lambda x, weight, eps, dtype=None: x.new_empty(x.shape, dtype=dtype or x.dtype),
    "output_gate": lambda o, gate, weight, eps, dtype: gate.new_empty(gate.shape, dtype=dtype),
    "kda_inputs": lambda qkv, z, b, A_log, dt_bias, lower_bound: (
        *(_new(qkv, qkv.shape[:-3] + qkv.shape[-2:]) for _ in range(3)), _new(qkv, b.shape)),
}


@functools.lru_cache(maxsize=None)
def custom_op(op: str, kernel: Callable) -> Callable:
    """``kernel`` (the Triton implementation of ``op``) registered once as ``torch.ops.minidsa.<op>``."""
    schema, mutates = SCHEMAS[op]
    registered = torch.library.custom_op(f"{NAMESPACE}::{op}", kernel, mutates_args=mutates, schema=schema)
    registered.register_fake(FAKES[op])
    return registered
