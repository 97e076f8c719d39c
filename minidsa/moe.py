"""Latent mixture of experts with MXFP4 routed experts converted online into one FP8 workspace
(SPEC sections 6 and 7).

    s = sigmoid(W_r x)                       router scores, fp32, on the full-width x
    chosen = top_k(s + e_score_correction_bias)   the bias only selects ...
    w_i = s_i / (sum_chosen s + 1e-20) * routed_scaling_factor   ... the weights use s alone
    z = W_down x                             into the latent width
    y = W_up RMSNorm(sum_i w_i E_i(z)) + Shared(x),  E_i(z) = W2_i SiTU-GLU(W1_i z, W3_i z)

Routed experts are stored packed (MXFP4: uint8 codes + E8M0 scales), stacked per layer as
[E, rows, K/2] and [E, rows, K/32]; the checkpoint names them per expert (``experts.{e}.w1.weight_packed``).
Before a layer computes, only the experts its tokens were routed to are converted into ONE FP8
workspace owned by the model and shared by every layer, so expert memory at run time does not grow
with depth. ``offline`` mode converts every expert once at load instead, for comparison.
"""

from __future__ import annotations

import torch
from torch import nn

from . import mxfp4
from .config import ModelConfig
from .ffn import SituGluMLP, situ_glu
from .norm import RMSNorm
from .ops import acc_dtype

ROUTER_EPS = 1e-20  # guards the renormalisation when every chosen score underflows to 0
EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate, up (latent -> I) and down (I -> latent)


class ExpertWorkspace:
    """One FP8 buffer for ``capacity`` experts, shared by all MoE layers of a model.

    elements[name]: float8_e4m3fn [capacity, rows, K]; scales[name]: uint8 [capacity, rows, K/32].
    ``conversions`` counts experts converted since the last ``reset_stats``.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str) -> None:
        m = cfg.moe
        self.capacity = m.workspace_experts
        shapes = expert_shapes(cfg)
        with torch.inference_mode(False):  # normal tensors, so later forwards may update them in place
            self._allocate(shapes, device)
        self.conversions = 0

    def _allocate(self, shapes, device) -> None:
        self.elements = {n: torch.empty((self.capacity,) + s, dtype=torch.float8_e4m3fn, device=device)
                         for n, s in shapes.items()}
        self.scales = {n: torch.empty((self.capacity, s[0], s[1] // mxfp4.GROUP), dtype=torch.uint8, device=device)
                       for n, s in shapes.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.elements, self.scales) for t in d.values())

    def load(self, layer: "LatentMoE", experts: torch.Tensor) -> None:
        """Convert the packed weights of ``experts`` (ids, at most ``capacity``) into slots 0..n-1."""
        n = experts.numel()
        for name in EXPERT_WEIGHTS:
            elements, scales = mxfp4.to_fp8(layer.packed[name][experts], layer.scale[name][experts])
            self.elements[name][:n] = elements
            self.scales[name][:n] = scales
        self.conversions += n


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Logical [rows, K] of each routed expert matrix."""
    L, I = cfg.moe.latent_size, cfg.moe.expert_intermediate_size
    return {"w1": (I, L), "w3": (I, L), "w2": (L, I)}


class LatentMoE(nn.Module):
    """``block_sparse_moe`` of one layer. forward(x_hat [B, T, d]) -> [B, T, d]."""

    def __init__(self, cfg: ModelConfig, workspace_ref) -> None:
        super().__init__()
        m = cfg.moe
        d = cfg.hidden_size
        self.num_experts, self.top_k, self.scaling = m.num_experts, m.top_k, m.routed_scaling_factor
        self.beta_gate, self.beta_up = cfg.activation_beta_gate, cfg.activation_beta_up
        self.gate = nn.Linear(d, m.num_experts, bias=False)  # router, kept fp32
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(m.num_experts))  # selection-only bias
        self.routed_expert_down_proj = nn.Linear(d, m.latent_size, bias=False)
        self.routed_expert_norm = RMSNorm(m.latent_size, cfg.rms_norm_eps)
        self.routed_expert_up_proj = nn.Linear(m.latent_size, d, bias=False)
        self.shared_experts = SituGluMLP(d, m.shared_intermediate_size, cfg.activation_beta_gate,
                                         cfg.activation_beta_up)
        for name, (rows, k) in expert_shapes(cfg).items():
            self.register_buffer(f"{name}_packed", torch.zeros(m.num_experts, rows, k // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.zeros(m.num_experts, rows, k // mxfp4.GROUP,
                                                              dtype=torch.uint8))
        self._workspace_ref = workspace_ref  # callable -> the model's ExpertWorkspace (not a submodule)
        self.offline: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        # Lazy loading: (expert, "w1", "weight_packed") -> (shard path, tensor name, target view), read on first use.
        self.lazy_source: dict[tuple[int, str, str], tuple] = {}
        self.resident = torch.ones(m.num_experts, dtype=torch.bool, device="cpu")  # experts with packed data in memory

    @property
    def packed(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, f"{n}_packed") for n in EXPERT_WEIGHTS}

    @property
    def scale(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, f"{n}_scale") for n in EXPERT_WEIGHTS}

    def materialize(self, experts: torch.Tensor | None = None) -> None:
        """Read the packed data of ``experts`` (default: all) from the checkpoint if still on disk."""
        if not self.lazy_source:
            return
        from .checkpoint import read_tensor

        ids = range(self.num_experts) if experts is None else experts.tolist()
        for e in ids:
            if self.resident[e]:
                continue
            keys = [(e, w, kind) for w in EXPERT_WEIGHTS for kind in ("weight_packed", "weight_scale")]
            for key in keys:
                read_tensor(*self.lazy_source[key])  # raises (naming the tensor) before anything is forgotten
            for key in keys:
                del self.lazy_source[key]
            self.resident[e] = True

    def convert_all(self) -> None:
        """Offline mode: every expert to FP8 once (memory grows with depth; no per-forward conversion)."""
        self.materialize()
        self.offline = {n: mxfp4.to_fp8(self.packed[n], self.scale[n]) for n in EXPERT_WEIGHTS}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (expert ids int64 [N, top_k], weights fp32 [N, top_k])."""
        acc = acc_dtype(x)
        s = torch.sigmoid(nn.functional.linear(x.to(acc), self.gate.weight.to(acc)))
        biased = s + self.gate.e_score_correction_bias.to(acc)
        ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, : self.top_k]  # ties -> lower id
        chosen = s.gather(1, ids)
        return ids, chosen / (chosen.sum(-1, keepdim=True) + ROUTER_EPS) * self.scaling

    def _expert(self, z: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """One expert on its tokens: z [n, latent] -> [n, latent]."""
        h = situ_glu(z @ w["w1"].T, z @ w["w3"].T, self.beta_gate, self.beta_up)
        return h @ w["w2"].T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        acc = acc_dtype(x)
        ids, weights = self.route(x)
        z = self.routed_expert_down_proj(x).to(acc)
        y_lat = torch.zeros_like(z)
        routed = torch.unique(ids)  # sorted: the conversion order is deterministic
        ws = self._workspace_ref()
        step = routed.numel() if self.offline is not None else ws.capacity
        for start in range(0, routed.numel(), step):  # rounds only if the routed set exceeds the workspace
            batch = routed[start: start + step]
            if self.offline is None:
                self.materialize(batch)
                ws.load(self, batch)
                n = batch.numel()
                mats = {w: mxfp4.fp8_dequantize(ws.elements[w][:n], ws.scales[w][:n], acc) for w in EXPERT_WEIGHTS}
            else:
                mats = {w: mxfp4.fp8_dequantize(el[batch], sc[batch], acc) for w, (el, sc) in self.offline.items()}
            for slot, e in enumerate(batch.tolist()):
                w = {name: m[slot] for name, m in mats.items()}
                rows, k = (ids == e).nonzero(as_tuple=True)
                y_lat.index_add_(0, rows, self._expert(z[rows], w) * weights[rows, k].unsqueeze(-1))
        y = self.routed_expert_up_proj(self.routed_expert_norm(y_lat.to(x.dtype)))
        return (y + self.shared_experts(x)).reshape(shape)
