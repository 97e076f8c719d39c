"""Public ops: each is its reference (``<op>/reference.py``), registered there by one ``@op(...)`` that names
its Triton kernel, its CPU form, its sm_90 (Gluon) form and its fake (ops/_dispatch.py); ``<op>.reference`` (and
``<op>_ref``) is the formula undispatched.

Every op takes ``backend=`` ("torch", "triton", "gluon", "auto", or None for the backend in force: see
``use_backend`` / ``set_backend``). The references compute in fp32 (fp64 when given fp64). The
paged ops read the KV cache the way a kernel does (planes [num_blocks, block_size, width], int32
block tables, int32 indices with -1 = padding, never read); the dense ops are what they are tested
against. See docs/design.md §12.
"""

from __future__ import annotations

import torch

from ._checks import acc_dtype, cast
from ._dispatch import (
    BACKENDS,
    CPU_FORMS,
    GLUON_KERNELS,
    OPS,
    REFERENCES,
    TRITON_KERNELS,
    current_backend,
    pick,
    register_custom_ops,
    set_backend,
    use_backend,
)
from .activation.reference import situ_glu, situ_glu_backward, situ_glu_backward_ref, situ_glu_ref
from .attention.reference import (
    gather_rows,
    indices_to_mask,
    masked_dense_attention,
    sparse_attention,
    sparse_attention_ref,
)
from .attn_res.reference import attn_res_block_scores, attn_res_merge, attn_res_mix, attn_res_mix_ref
from .gate.reference import output_gate, output_gate_ref
from .indexer.reference import (
    index_scores,
    index_scores_ref,
    paged_index_scores,
    paged_index_scores_ref,
    topk_indices,
    topk_indices_ref,
)
from .kda.reference import kda_chunk, kda_chunk_ref, kda_recurrent, kda_recurrent_ref
from .kda_step.reference import (
    causal_conv,
    conv_states_at,
    kda_decode,
    kda_decode_ref,
    kda_inputs,
    kda_inputs_ref,
    short_conv,
    short_conv_ref,
)
from .kv_store.reference import store_kv, store_kv_ref
from .linear.reference import linear, linear_ref, linear_sum, linear_sum_ref
from .mla.reference import (
    PREFILL_TILE,
    decompress_kv,
    sparse_mla_decode,
    sparse_mla_decode_ref,
    sparse_mla_prefill,
    sparse_mla_prefill_ref,
)
from .moe_experts.reference import (
    expert_mlp_fp8,
    expert_mlp_fp8_ref,
    expert_mlp_mxfp4,
    expert_mlp_mxfp4_ref,
    mxfp4_to_fp8,
    mxfp4_to_fp8_ref,
)
from .moe_router.reference import moe_plan, moe_plan_ref, moe_route, moe_route_ref, route_weights
from .norm.reference import rms_norm, rms_norm_ref
from .paging import gather_positions, paged_kv_slots

__all__ = ["BACKENDS", "TRITON_KERNELS", "CPU_FORMS", "GLUON_KERNELS", "OPS", "REFERENCES", "acc_dtype", "cast",
           "current_backend", "set_backend", "register_custom_ops", "pick",
           "use_backend", "index_scores", "paged_index_scores", "topk_indices", "sparse_attention",
           "masked_dense_attention", "indices_to_mask", "gather_rows", "store_kv", "sparse_mla_decode",
           "sparse_mla_prefill", "decompress_kv", "paged_kv_slots", "gather_positions", "PREFILL_TILE",
           "kda_recurrent", "kda_chunk", "attn_res_mix", "attn_res_block_scores", "attn_res_merge",
           "mxfp4_to_fp8", "expert_mlp_fp8", "expert_mlp_mxfp4", "situ_glu", "situ_glu_backward",
           "linear", "linear_sum", "moe_route", "moe_plan", "route_weights", "kda_decode", "kda_step_inputs",
           "kda_inputs", "causal_conv", "conv_states_at", "short_conv", "rms_norm", "output_gate",
           "index_scores_ref", "paged_index_scores_ref", "topk_indices_ref", "sparse_attention_ref", "store_kv_ref",
           "sparse_mla_decode_ref", "sparse_mla_prefill_ref", "kda_recurrent_ref", "kda_chunk_ref", "kda_decode_ref",
           "short_conv_ref", "kda_inputs_ref", "attn_res_mix_ref", "mxfp4_to_fp8_ref", "expert_mlp_fp8_ref",
           "expert_mlp_mxfp4_ref", "situ_glu_ref", "situ_glu_backward_ref", "linear_ref", "linear_sum_ref",
           "moe_route_ref", "moe_plan_ref", "rms_norm_ref", "output_gate_ref"]


def kda_step_inputs(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    lower_bound: float, *, backend: str | None = None):
    """KDA's per-token inputs from the short convs' SiLU outputs: qkv [..., 3, H, K], z [..., H*K] (W_fb W_fa x),
    b [..., H] -> (q, k (L2-normalised per head), v [..., H, K], g [..., H, K] (log-decay), beta [..., H]) in
    the accumulation dtype; v is qkv's view. The op is ``kda_inputs`` (ops/kda_step/reference.py)."""
    q, k, g, beta = kda_inputs(qkv, z, b, A_log, dt_bias, lower_bound, backend=backend)
    return q, k, qkv[..., 2, :, :], g, beta

