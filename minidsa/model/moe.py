"""Latent mixture of experts (docs/design.md §6, §7): the layer as its formula.

    s = sigmoid(W_r x)                       router scores, fp32, on the full-width x
    chosen = top_k(s + e_score_correction_bias)   the bias only selects ...
    w_i = s_i / (sum_chosen s + 1e-20) * routed_scaling_factor   ... the weights use s alone
    z = W_down x                             into the latent width
    y = W_up RMSNorm(sum_i w_i E_i(z)) + Shared(x),  E_i(z) = W2_i SiTU-GLU(W1_i z, W3_i z)

Where the routed experts are stored and how sum_i w_i E_i(z) is computed (MXFP4 storage, the shared FP8
workspace, lazy loading, expert parallelism) is ``model/experts.py``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..ops import acc_dtype, cast
from .experts import ExpertWorkspace, RoutedExperts
from .ffn import SituGluMLP, situ_glu
from .fused import FusedLinears
from .norm import RMSNorm
from .trace import ForwardTrace, held_choice, token_pieces


class LatentMoE(nn.Module):
    """``block_sparse_moe`` of one layer. forward(x_hat [B, T, d]) -> [B, T, d]."""

    parallel = None  # a distributed Comm when the routed experts are split over ranks (minidsa/distributed)

    def __init__(self, cfg: ModelConfig, workspace: Callable[[], ExpertWorkspace]) -> None:
        super().__init__()
        m = cfg.moe
        d = cfg.hidden_size
        self.num_experts, self.top_k, self.routed_scaling_factor = m.num_experts, m.top_k, m.routed_scaling_factor
        self.gate = nn.Linear(d, m.num_experts, bias=False)  # router, kept fp32
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(m.num_experts))  # selection-only bias
        self.routed_expert_down_proj = nn.Linear(d, m.latent_size, bias=False)
        self.routed_expert_norm = RMSNorm(m.latent_size, cfg.rms_norm_eps)
        self.routed_expert_up_proj = nn.Linear(m.latent_size, d, bias=False)
        self.shared_experts = SituGluMLP(d, m.shared_intermediate_size, cfg.activation_beta_gate,
                                         cfg.activation_beta_up)
        # the router, the latent down projection and the shared expert's two projections read the same x
        self.input_proj = FusedLinears(self.gate, self.routed_expert_down_proj, self.shared_experts.gate_proj,
                                       self.shared_experts.up_proj)
        self.up = FusedLinears(self.routed_expert_up_proj)  # a single layer too: the CPU layout (model/fused.py)
        self.experts = RoutedExperts(cfg, workspace)  # storage, residency, the workspace: model/experts.py

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, trace: ForwardTrace | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights, z, gate, up = self.project(x, trace, shape[0])
        y_lat = self.experts(z, ids, weights, acc_dtype(x))  # sum_i w_i E_i(z), [N, latent]
        if self.parallel is not None:  # each rank summed its own experts: the sum is whole before the norm
            y_lat = self.parallel.ep_all_reduce(y_lat)
        return self.combine(y_lat, gate, up, x.dtype).reshape(shape)

    def project(self, x: torch.Tensor, trace: ForwardTrace | None = None, rows: int = 1) -> tuple[torch.Tensor, ...]:
        """x [N, d] -> (ids, weights, z [N, latent] in x's dtype, the shared expert's gate and up projections):
        everything the layer computes from x, as one input product. The router's rows are in fp32 in every
        model but a float64 one (its weight is kept fp32). The expert ops accumulate in fp32 whatever z's
        dtype; the GPU's kernels read a bf16 z as it is (and need one tensor-core product for it, not two).
        A ``trace`` may hold the route (model/trace.py): x's N tokens are then ``rows`` pieces unless it says."""
        logits, z, gate, up = self.input_proj(x)
        logits = cast(logits, acc_dtype(x))
        ids, weights = held_choice(trace, self, lambda: trace.pieces or token_pieces(None, rows, x.shape[0] // rows),
                                   lambda: self.choose(logits), lambda out: out[0],
                                   lambda ids: (ids, self.route_weights(torch.sigmoid(logits), ids)))
        return ids, weights, z, gate, up

    def combine(self, y_lat: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The routed experts' latent sum y_lat [N, latent] and the shared expert's projections -> [N, d]."""
        normed = self.routed_expert_norm(y_lat, dtype)
        shared = self.shared_experts
        if self._one_product(normed):
            h = situ_glu(gate, up, shared.beta_gate, shared.beta_up)
            return ops.linear_sum(normed, self.routed_expert_up_proj.weight, h, shared.down_proj.weight)
        return self.up(normed)[0] + shared.finish(gate, up)

    def _one_product(self, x: torch.Tensor) -> bool:
        """Whether ``combine`` ends in ``ops.linear_sum``: the routed up projection and the shared expert's down
        projection end in one sum, so a decode row needs one launch for both. Not on the CPU, which keeps its
        K-major layout of the up projection (model/fused.py), nor when the shared expert's rows are split
        over ranks (its product is a partial sum until the all-reduce; the routed one is whole)."""
        return x.device.type != "cpu" and self.shared_experts.parallel is None

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [N, E] -> (expert ids int64 [N, top_k], weights fp32 [N, top_k]): top_k of the sigmoid
        affinities s plus the selection bias, weighted by s itself (DeepSeek-V3's aux-loss-free balancing;
        ``ops.moe_route``)."""
        return ops.moe_route(logits, self.gate.e_score_correction_bias, self.top_k, self.routed_scaling_factor)

    def route_weights(self, s: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Affinities s [N, E] of the chosen experts ids [N, top_k], renormalised and scaled -> [N, top_k]."""
        return ops.route_weights(s, ids, self.routed_scaling_factor)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (expert ids int64 [N, top_k], weights fp32 [N, top_k]), as the forward routes."""
        return self.project(x)[:2]
