"""The routed experts of one MoE layer as they are stored, and where they are computed (docs/design.md §6, §7).

    RoutedExperts(z, ids, weights) = sum_i w_i E_i(z),   E_i(z) = W2_i SiTU-GLU(W1_i z, W3_i z)

``model/moe.py`` reads as that formula; everything about *where the expert weights are* lives here:
- **Storage.** Routed experts are stored packed (MXFP4: uint8 codes + E8M0 scales). One expert's three
  matrices (w1, w3, w2: each rows x K = I x latent elements) are one contiguous block, so a layer holds
  ``packed`` [E, 3, I*latent/2] and ``scales`` [E, 3, I*latent/32] and converting an expert is one pass
  over one block. The checkpoint names each matrix per expert (``experts.{e}.w1.weight_packed``).
- **The shared workspace.** Prefill-sized calls convert the experts their tokens were routed to into ONE
  FP8 workspace owned by the model and shared by every layer, so expert memory at run time does not grow
  with depth; its lock is held from the conversion to the last read. ``offline`` mode converts every
  expert once instead, for comparison.
- **Lazy residency.** A model loaded with ``lazy_experts=True`` reads an expert's data on first use.
- **Expert parallelism.** A rank holds a contiguous range of experts; tokens routed elsewhere get nothing
  from this rank's copy (an all-reduce in the layer sums the ranks' parts).
- **The path.** A decode-sized call reads its experts straight from MXFP4; larger ones go through the
  workspace.

No step needs the routing on the host (docs/design.md §14): a call converts min(tokens * top_k, E) slots,
known from shapes alone, with the routed experts first in ascending id order; the slots past them hold
experts no token reads. The expert compute is dense over the slots, weighted by a routing-weight matrix
that is zero for unrouted pairs.
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
from ..ops import cast
from ..ops._checks import on_host

# Up to this many tokens per layer call (a decode batch of up to 32 sequences) the routed experts are read
# straight from MXFP4; prefill-sized calls convert them into the shared FP8 workspace, once for all tokens.
DIRECT_MAX_TOKENS = 32
EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate, up (latent -> I) and down (I -> latent)


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Logical [rows, K] of each routed expert matrix."""
    L, I = cfg.moe.latent_size, cfg.moe.expert_intermediate_size
    return {"w1": (I, L), "w3": (I, L), "w2": (L, I)}


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

    def load(self, store: "RoutedExperts", experts: torch.Tensor) -> None:
        """Convert the packed weights of ``experts`` (ids [n], n <= capacity) into slots 0..n-1."""
        ops.mxfp4_to_fp8(store.packed, store.scales, experts, self.elements, self.scales)


class RoutedExperts(nn.Module):
    """``block_sparse_moe.experts``: forward(z [N, latent], ids int64 [N, top_k], weights fp32 [N, top_k])
    -> [N, latent] in ``acc`` (fp32, fp64 kept), the routed experts' outputs summed with their weights."""

    def __init__(self, cfg: ModelConfig, workspace: Callable[[], ExpertWorkspace]) -> None:
        super().__init__()
        m = cfg.moe
        self.num_experts = m.num_experts
        self.beta_gate, self.beta_up = cfg.activation_beta_gate, cfg.activation_beta_up
        self.shapes = expert_shapes(cfg)
        n = m.latent_size * m.expert_intermediate_size  # elements per expert matrix
        self.register_buffer("packed", torch.zeros(m.num_experts, 3, n // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(m.num_experts, 3, n // mxfp4.GROUP, dtype=torch.uint8))
        self._workspace = workspace  # callable -> the model's ExpertWorkspace (shared, so not a submodule)
        self.offline: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8 elements and scales of every expert
        # Lazy loading: (expert, "w1", "weight_packed") -> a reader that fills that tensor (checked) from disk.
        self.lazy_source: dict[tuple[int, str, str], Callable[[], None]] = {}
        self.resident = torch.ones(m.num_experts, dtype=torch.bool, device="cpu")  # experts with packed data in memory
        self.ids = range(m.num_experts)  # the routed experts held here: all, or one rank's range

    # ---------------------------------------------------------------- storage
    def matrix(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert matrix ``name`` ("w1", "w3", "w2") of every expert held: (codes uint8 [E, rows, K/2], E8M0
        scales uint8 [E, rows, K/32]), views of the stacked blocks."""
        j = EXPERT_WEIGHTS.index(name)
        rows, k = self.shapes[name]
        return (self.packed[:, j].unflatten(-1, (rows, k // 2)),
                self.scales[:, j].unflatten(-1, (rows, k // mxfp4.GROUP)))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """{"{e}.w1.weight_packed": uint8 [rows, K/2], "{e}.w1.weight_scale": [rows, K/32], ...} views."""
        out = {}
        for name in EXPERT_WEIGHTS:
            for kind, t in zip(("weight_packed", "weight_scale"), self.matrix(name)):
                out.update({f"{e}.{name}.{kind}": t[i] for i, e in enumerate(self.ids)})
        return out

    def keep(self, experts: range) -> None:
        """Hold only the routed experts ``experts`` (a contiguous range: one rank's under expert parallelism);
        the router still scores all of them, and tokens routed elsewhere get nothing from this copy."""
        self.packed = self.packed[experts.start: experts.stop].clone()
        self.scales = self.scales[experts.start: experts.stop].clone()
        self.resident = self.resident[experts.start: experts.stop].clone()
        self.ids = experts

    @torch.no_grad()
    def init_seeded(self, generator: torch.Generator, std: float) -> None:
        """Seeded N(0, std) expert weights, stored in MXFP4: drawn on the CPU (the same weights on every
        machine) and quantized where the layer lives (exact arithmetic, so on any device the same codes)."""
        for name, (rows, k) in self.shapes.items():
            w = torch.randn(self.num_experts, rows, k, generator=generator) * std
            codes, scales = self.matrix(name)
            packed, e8m0 = mxfp4.quantize(w.to(codes.device))
            codes.copy_(packed)
            scales.copy_(e8m0)

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
        self.offline = mxfp4.to_fp8(self.packed, self.scales)

    def refresh_offline(self) -> None:
        """The offline FP8 copy made again from the packed data (after the packed data changed)."""
        if self.offline is not None:
            self.offline = mxfp4.to_fp8(self.packed, self.scales)

    # ---------------------------------------------------------------- compute
    def forward(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        if len(self.ids) < self.num_experts:  # this rank's experts only: ids local, the others' weights 0
            lo, mine = self.ids.start, (ids >= self.ids.start) & (ids < self.ids.stop)
            ids, weights = torch.where(mine, ids - lo, 0), torch.where(mine, weights, 0.0)
        with self._exclusive():
            if self.lazy_source:  # experts still on disk: the host must decide which to read (not graph-capturable)
                self.materialize(torch.unique(ids))
            return self._compute(z, ids, weights, acc)

    def plan(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids, weights [N, top_k] -> (experts int64 [n], routing weights [n, N], number routed: a device
        scalar), n = min(N * top_k, E) (``ops.moe_plan``): the routed experts first in ascending id order,
        then placeholders; [j, t] is the weight token t gives experts[j] (0 = not routed)."""
        return ops.moe_plan(ids, weights, self.num_experts)

    def _exclusive(self):
        """The shared workspace's lock (online mode; a no-op while torch.compile traces, which has no threads)."""
        if self.offline is not None and not self.lazy_source or torch.compiler.is_compiling():
            return contextlib.nullcontext()
        return self._workspace().lock

    def _compute(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        direct = self.offline is None and ids.shape[0] <= DIRECT_MAX_TOKENS
        if direct and ids.shape[0] == 1:
            # One token: its top_k distinct experts, in routing order, are the slots and its weights the
            # routing weights (no plan to sort or matrix to build: two fewer launches in a decode step).
            return ops.expert_mlp_mxfp4(z, self.packed, self.scales, ids[0], cast(weights.view(-1, 1), acc),
                                        self.beta_gate, self.beta_up)
        experts, routing, num_routed = self.plan(ids, weights)  # routing [m, N], 0 = not routed
        if on_host(ids) and not torch.compiler.is_compiling():
            routed = int(num_routed)  # a sync costs nothing here: skip converting the placeholders
            experts, routing = experts[:routed], routing[:routed]
        if direct:
            # A decode-sized batch reads each routed expert's weights about once: decoding them where the
            # product uses them (matrix-vector for one token, tensor-core tiles shared by an expert's tokens
            # above) reads a fifth of the bytes of converting into the workspace and reading that back
            # (docs/design.md §17).
            return ops.expert_mlp_mxfp4(z, self.packed, self.scales, experts, cast(routing, acc), self.beta_gate,
                                        self.beta_up)
        if self.offline is None:
            self._workspace().routed += num_routed  # the placeholders are not counted
        step = experts.numel() if self.offline is not None else self._workspace().capacity
        y_lat = None  # [N, latent]: the rounds' outputs summed (one round unless the batch exceeds the workspace)
        for start in range(0, experts.numel(), step):
            batch = experts[start: start + step]
            # at most top_k pairs per token: the kernel's buffers sized without reading the count back
            part = ops.expert_mlp_fp8(z, *self._slots(batch), cast(routing[start: start + step], acc), self.beta_gate,
                                      self.beta_up, ids.numel())
            y_lat = part if y_lat is None else y_lat + part
        return y_lat

    def _slots(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 elements and scales whose slots 0..m-1 hold ``experts`` [m]: the shared workspace after
        converting them, or (offline mode) the experts picked from the all-expert FP8 copy."""
        if self.offline is not None:
            return self.offline[0].index_select(0, experts), self.offline[1].index_select(0, experts)
        ws = self._workspace()
        ws.load(self, experts)
        return ws.elements, ws.scales


def expert_stats(stores: list[RoutedExperts], workspace: ExpertWorkspace | None) -> dict[str, int]:
    """Bytes of packed expert storage (and of the same experts in bf16), workspace bytes, FP8 bytes held
    by offline mode, routed experts converted since the last reset and in the last forward."""
    packed = sum(s.packed.numel() + s.scales.numel() for s in stores)
    elements = sum(s.packed.numel() * 2 for s in stores)
    offline = sum(t.numel() * t.element_size() for s in stores if s.offline is not None for t in s.offline)
    total, last = workspace.routed.tolist() if workspace is not None else (0, 0)
    return {"expert_bytes_mxfp4": packed, "expert_bytes_bf16": 2 * elements,
            "workspace_bytes": workspace.nbytes if workspace is not None else 0, "offline_fp8_bytes": offline,
            "conversions": total, "conversions_last_forward": last,
            "experts_resident": sum(int(s.resident.sum()) for s in stores)}
