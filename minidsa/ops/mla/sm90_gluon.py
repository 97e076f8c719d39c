"""The sparse MLA ops on Hopper (sm_90): the Gluon kernels for the calls they fit, the Triton kernels for the rest.

The backend "gluon" (and "auto" on a capability-9.0 GPU) runs these forms. Each is its Triton form
(latent_triton.py, prefill_triton.py: the same host work, grids and row-number passes) with the attention
handed to a Gluon kernel where that kernel fits the call:
- latent_gluon.py, the absorbed latent attention of decode and of the absorbed prefill: bf16/fp16 planes,
  r 256 or 512, more than 16 heads (``latent_gluon.gluon_fits``);
- prefill_gluon.py, the union form's attention: bf16/fp16, dn = dv, 128-query tiles
  (``prefill_attn_triton.gluon_attends``).
Same signatures, contracts and tolerances as the references (ops/mla/reference.py). Gluon has no interpreter:
these run on a GPU only (tests/ops/test_mla_gluon.py, test_mla_prefill_gluon.py).
"""

from __future__ import annotations

import torch

from . import latent_gluon, prefill_gluon
from .latent_triton import latent_decode
from .prefill_triton import prefill


def sparse_mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_latent_plane: torch.Tensor,
                      k_pe_plane: torch.Tensor, block_table: torch.Tensor, indices: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """``sparse_mla_decode_ref``'s contract: the latent attention on latent_gluon.py where it fits."""
    return latent_decode(q_latent, q_pe, kv_latent_plane, k_pe_plane, block_table, indices, scale,
                         gluon=latent_gluon)


def sparse_mla_prefill(q: torch.Tensor, kv_latent_plane: torch.Tensor, k_pe_plane: torch.Tensor,
                       block_table: torch.Tensor, indices: torch.Tensor, kv_b_weight: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """``sparse_mla_prefill_ref``'s contract: the union attention on prefill_gluon.py, the absorbed form's on
    latent_gluon.py, where each fits."""
    return prefill(q, kv_latent_plane, k_pe_plane, block_table, indices, kv_b_weight, scale,
                   union_gluon=prefill_gluon, latent_gluon=latent_gluon)
