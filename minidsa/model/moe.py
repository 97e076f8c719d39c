"""Latent mixture of experts with MXFP4 routed experts converted online into one FP8 workspace
(docs/design.md §6, §7).

    s = sigmoid(W_r x)                       router scores, fp32, on the full-width x
    chosen = top_k(s + e_score_correction_bias)   the bias only selects ...
    w_i = s_i / (sum_chosen s + 1e-20) * routed_scaling_factor   ... the weights use s alone
    z = W_down x                             into the latent width
    y = W_up RMSNorm(sum_i w_i E_i(z)) + Shared(x),  E_i(z) = W2_i SiTU-GLU(W1_i z, W3_i z)

Routed experts are stored packed (MXFP4: uint8 codes + E8M0 scales). In memory one expert's three
matrices (w1, w3, w2: each rows x K = I x latent elements) are one contiguous block, so a layer's
storage is [E, 3, I*latent/2] codes and [E, 3, I*latent/32] scales and converting an expert is one
pass over one block; ``packed`` / ``scales`` give the per-matrix views [E, rows, K/2] / [E, rows, K/32],
which the checkpoint names per expert (``experts.{e}.w1.weight_packed``).
Before a layer computes, the experts its tokens were routed to are converted into ONE FP8 workspace
owned by the model and shared by every layer, so expert memory at run time does not grow with depth.
``offline`` mode converts every expert once instead, for comparison.

No step here needs the routing on the host (docs/design.md §14): the layer converts a batch of
min(tokens * top_k, num_experts) slots, known from shapes alone, with the routed experts first in
ascending id order; slots past the routed ones hold experts no token reads. The expert compute is
dense over the converted slots, weighted by a routing matrix that is zero for unrouted pairs.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..formats import mxfp4
from ..ops import acc_dtype, cast
from ..ops._checks import on_host
from .ffn import SituGluMLP, situ_glu
from .fused import FusedLinears
from .norm import RMSNorm

# Up to this many tokens per layer call (a decode batch of up to 32 sequences) the routed experts are read
# straight from MXFP4; prefill-sized calls convert them into the shared FP8 workspace, once for all tokens.
DIRECT_MAX_TOKENS = 32
EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate, up (latent -> I) and down (I -> latent)


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Logical [rows, K] of each routed expert matrix."""
    L, I = cfg.moe.latent_size, cfg.moe.expert_intermediate_size
    return {"w1": (I, L), "w3": (I, L), "w2": (L, I)}


def split_matrices(block: torch.Tensor, cfg_shapes: dict[str, tuple[int, int]], per_element: int) -> dict:
    """[..., 3, n] expert blocks -> {"w1", "w3", "w2": [..., rows, K / per_element]} views."""
    return {name: block[..., j, :].unflatten(-1, (rows, k // per_element))
            for j, (name, (rows, k)) in enumerate(cfg_shapes.items())}


class ExpertWorkspace:
    """One FP8 buffer for ``capacity`` experts, shared by all MoE layers of a model.

    elements: float8_e4m3fn [capacity, 3, I*latent]; scales: uint8 [capacity, 3, I*latent/32] (w1, w3, w2).
    ``routed`` int64 [2] counts routed experts converted: since the last reset, and in the current
    forward. It stays on the device (no host sync per layer) and is read only by ``expert_stats``.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str) -> None:
        self.capacity = cfg.moe.workspace_experts
        n = cfg.moe.latent_size * cfg.moe.expert_intermediate_size
        with torch.inference_mode(False):  # normal tensors, so later forwards may update them in place
            self.elements = torch.empty(self.capacity, 3, n, dtype=torch.float8_e4m3fn, device=device)
            self.scales = torch.empty(self.capacity, 3, n // mxfp4.GROUP, dtype=torch.uint8, device=device)
            self.routed = torch.zeros(2, dtype=torch.long, device=device)
        # Held from a layer's conversion into the slots to its last read of them: two threads running the
        # same model would otherwise convert their experts over each other's (wrong logits, no error).
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.elements.numel() * self.elements.element_size() + self.scales.numel()

    def load(self, layer: "LatentMoE", experts: torch.Tensor) -> None:
        """Convert the packed weights of ``experts`` (ids [n], n <= capacity) into slots 0..n-1."""
        ops.mxfp4_to_fp8(layer.experts_packed, layer.experts_scale, experts, self.elements, self.scales)


class LatentMoE(nn.Module):
    """``block_sparse_moe`` of one layer. forward(x_hat [B, T, d]) -> [B, T, d]."""

    parallel = None  # a distributed Comm when the routed experts are split over ranks (minidsa/distributed)

    def __init__(self, cfg: ModelConfig, workspace: Callable[[], ExpertWorkspace]) -> None:
        super().__init__()
        m = cfg.moe
        d = cfg.hidden_size
        self.num_experts, self.top_k, self.routed_scaling_factor = m.num_experts, m.top_k, m.routed_scaling_factor
        self.beta_gate, self.beta_up = cfg.activation_beta_gate, cfg.activation_beta_up
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
        self.shapes = expert_shapes(cfg)
        n = m.latent_size * m.expert_intermediate_size  # elements per expert matrix
        self.register_buffer("experts_packed", torch.zeros(m.num_experts, 3, n // 2, dtype=torch.uint8))
        self.register_buffer("experts_scale", torch.zeros(m.num_experts, 3, n // mxfp4.GROUP, dtype=torch.uint8))
        self._workspace = workspace  # callable -> the model's ExpertWorkspace (shared, so not a submodule)
        self.offline: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8 elements and scales of every expert
        # Lazy loading: (expert, "w1", "weight_packed") -> a reader that fills that tensor (checked) from disk.
        self.lazy_source: dict[tuple[int, str, str], Callable[[], None]] = {}
        self.resident = torch.ones(m.num_experts, dtype=torch.bool, device="cpu")  # experts with packed data in memory
        self.expert_ids = range(m.num_experts)  # the routed experts held here: all, or one rank's range

    @property
    def packed(self) -> dict[str, torch.Tensor]:
        """uint8 [E, rows, K/2] E2M1 codes of each expert matrix (views of ``experts_packed``)."""
        return split_matrices(self.experts_packed, self.shapes, 2)

    @property
    def scales(self) -> dict[str, torch.Tensor]:
        """uint8 [E, rows, K/32] E8M0 scales of each expert matrix (views of ``experts_scale``)."""
        return split_matrices(self.experts_scale, self.shapes, mxfp4.GROUP)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """{"experts.{e}.w1.weight_packed": uint8 [rows, K/2], "...weight_scale": [rows, K/32], ...} views."""
        out = {}
        for kind, mats in (("weight_packed", self.packed), ("weight_scale", self.scales)):
            for name, t in mats.items():
                out.update({f"experts.{e}.{name}.{kind}": t[i] for i, e in enumerate(self.expert_ids)})
        return out

    def keep_experts(self, experts: range) -> None:
        """Hold only the routed experts ``experts`` (a contiguous range: one rank's under expert parallelism);
        the router still scores all of them, and tokens routed elsewhere get nothing from this layer's copy."""
        self.experts_packed = self.experts_packed[experts.start: experts.stop].clone()
        self.experts_scale = self.experts_scale[experts.start: experts.stop].clone()
        self.resident = self.resident[experts.start: experts.stop].clone()
        self.expert_ids = experts

    @torch.no_grad()
    def init_experts(self, generator: torch.Generator, std: float) -> None:
        """Seeded N(0, std) expert weights, stored in MXFP4: drawn on the CPU (the same weights on every
        machine) and quantized where the layer lives (exact arithmetic, so on any device the same codes)."""
        for name, (rows, k) in self.shapes.items():
            w = torch.randn(self.num_experts, rows, k, generator=generator) * std
            packed, scales = mxfp4.quantize(w.to(self.packed[name].device))
            self.packed[name].copy_(packed)
            self.scales[name].copy_(scales)

    # ---------------------------------------------------------------- residency
    def materialize(self, experts: torch.Tensor | None = None) -> None:
        """Read the packed data of ``experts`` (default: all) from the checkpoint if still on disk."""
        if not self.lazy_source:
            return
        for e in range(self.num_experts) if experts is None else experts.tolist():
            if self.resident[e]:
                continue
            keys = [(e, w, kind) for w in EXPERT_WEIGHTS for kind in ("weight_packed", "weight_scale")]
            for key in keys:
                self.lazy_source[key]()  # raises (naming the tensor) before anything is forgotten
            for key in keys:
                del self.lazy_source[key]
            self.resident[e] = True

    def convert_all(self) -> None:
        """Offline mode: every expert to FP8 once (memory grows with depth; no per-forward conversion)."""
        self.materialize()
        self.offline = mxfp4.to_fp8(self.experts_packed, self.experts_scale)

    # ---------------------------------------------------------------- forward
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (expert ids int64 [N, top_k], weights fp32 [N, top_k]), as the forward routes."""
        return self.project(x)[:2]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [N, d] -> (ids, weights, z [N, latent] in x's dtype, the shared expert's gate and up projections):
        everything the layer computes from x, as one input product. The router's rows are in fp32 in every
        model but a float64 one (its weight is kept fp32). The expert ops accumulate in fp32 whatever z's
        dtype; the GPU's kernels read a bf16 z as it is (and need one tensor-core product for it, not two)."""
        logits, z, gate, up = self.input_proj(x)
        ids, weights = self.choose(cast(logits, acc_dtype(x)))
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

    def conversion_plan(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids, weights [N, top_k] -> (experts int64 [n], gates [n, N], number routed: a device scalar),
        n = min(N * top_k, E) (``ops.moe_plan``).

        The routed experts come first in ascending id order, then unrouted placeholders; n is known
        from the shape alone, so planning needs no host sync. gates[j, t] is the weight token t gives
        experts[j] (0 = not routed): the expert ops run dense over the slots."""
        return ops.moe_plan(ids, weights, self.num_experts)

    def _slots(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 elements and scales whose slots 0..m-1 hold ``experts`` [m]: the shared workspace after
        converting them, or (offline mode) the experts picked from the all-expert FP8 copy."""
        if self.offline is not None:
            return self.offline[0].index_select(0, experts), self.offline[1].index_select(0, experts)
        ws = self._workspace()
        ws.load(self, experts)
        return ws.elements, ws.scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights, z, gate, up = self.project(x)
        if len(self.expert_ids) < self.num_experts:  # this rank's experts only: ids local, the others' gates 0
            lo, mine = self.expert_ids.start, (ids >= self.expert_ids.start) & (ids < self.expert_ids.stop)
            ids, weights = torch.where(mine, ids - lo, 0), torch.where(mine, weights, 0.0)
        with self._exclusive():
            y_lat = self._routed(z, ids, weights, acc_dtype(x))
        if self.parallel is not None:  # the experts' sum is whole before the (nonlinear) norm
            y_lat = self.parallel.ep_all_reduce(y_lat)
        return self.combine(y_lat, gate, up, x.dtype).reshape(shape)

    def _exclusive(self):
        """The shared workspace's lock (online mode; a no-op while torch.compile traces, which has no threads)."""
        if self.offline is not None and not self.lazy_source or torch.compiler.is_compiling():
            return contextlib.nullcontext()
        return self._workspace().lock

    def _routed(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        """[N, latent]: the routed experts' outputs in the latent space, summed with their gates."""
        if self.lazy_source:  # experts still on disk: the host must decide which to read (not graph-capturable)
            self.materialize(torch.unique(ids))
        direct = self.offline is None and ids.shape[0] <= DIRECT_MAX_TOKENS
        if direct and ids.shape[0] == 1:
            # One token: its top_k distinct experts, in routing order, are the slots and its weights the gates
            # (no plan to sort or routing matrix to build: two fewer launches in a decode step).
            return ops.expert_mlp_mxfp4(z, self.experts_packed, self.experts_scale, ids[0],
                                        cast(weights.view(-1, 1), acc), self.beta_gate, self.beta_up)
        experts, gates, num_routed = self.conversion_plan(ids, weights)  # gates [m, N], 0 = not routed
        if on_host(ids) and not torch.compiler.is_compiling():
            routed = int(num_routed)  # a sync costs nothing here: skip converting the placeholders
            experts, gates = experts[:routed], gates[:routed]
        if direct:
            # A decode-sized batch reads each routed expert's weights about once: decoding them where the
            # product uses them (matrix-vector for one token, tensor-core tiles shared by an expert's tokens
            # above) reads a fifth of the bytes of converting into the workspace and reading that back
            # (docs/design.md §17).
            return ops.expert_mlp_mxfp4(z, self.experts_packed, self.experts_scale, experts, cast(gates, acc),
                                        self.beta_gate, self.beta_up)
        if self.offline is None:
            self._workspace().routed += num_routed  # the placeholders are not counted
        step = experts.numel() if self.offline is not None else self._workspace().capacity
        y_lat = None  # [N, latent]: the rounds' outputs summed (one round unless the batch exceeds the workspace)
        for start in range(0, experts.numel(), step):
            batch = experts[start: start + step]
            # at most top_k pairs per token: the kernel's buffers sized without reading the count back
            part = ops.expert_mlp_fp8(z, *self._slots(batch), cast(gates[start: start + step], acc), self.beta_gate,
                                      self.beta_up, ids.numel())
            y_lat = part if y_lat is None else y_lat + part
        return y_lat


def expert_stats(layers: list[LatentMoE], workspace: ExpertWorkspace | None) -> dict[str, int]:
    """Bytes of packed expert storage (and of the same experts in bf16), workspace bytes, FP8 bytes held
    by offline mode, routed experts converted since the last reset and in the last forward."""
    packed = sum(t.numel() for m in layers for d in (m.packed, m.scales) for t in d.values())
    elements = sum(t.numel() * 2 for m in layers for t in m.packed.values())
    offline = sum(t.numel() * t.element_size() for m in layers if m.offline is not None for t in m.offline)
    total, last = workspace.routed.tolist() if workspace is not None else (0, 0)
    return {"expert_bytes_mxfp4": packed, "expert_bytes_bf16": 2 * elements,
            "workspace_bytes": workspace.nbytes if workspace is not None else 0, "offline_fp8_bytes": offline,
            "conversions": total, "conversions_last_forward": last,
            "experts_resident": sum(int(m.resident.sum()) for m in layers)}
