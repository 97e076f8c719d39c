"""Which rank holds which bytes: the sharding plan of tensor (TP) and expert (EP) parallelism.

Ranks 0..world-1, world = max(tp, ep) (the larger a multiple of the smaller). Rank r is TP rank r % tp and
EP rank r % ep. Per checkpoint tensor (names as released):
- **column** (split along dim 0, by heads or by intermediate rows): the projections into each head or
  channel, KDA's q/k/v/f_b/b/g projections, short convs and dt_bias, MLA's q_b, kv_b and output gate, the
  gate and up projections of the shared expert and of the dense MLP;
- **row** (split along dim 1): the projections back to the residual width, o_proj and the down projections.
  Each row-parallel product ends in one all-reduce per sub-layer;
- **experts**: routed expert e lives only on the EP rank e // (E / ep), packed in MXFP4;
- **replicated**: everything else. MLA's latent projections (q_a, kv_a) and the latent KV rows are per token,
  shared by all heads, so every TP rank holds them whole. The lightning indexer stays whole too: its
  scores are a sum over its heads before top-k, so splitting its heads would all-reduce a [T, S] score matrix
  per layer, more bytes than its weights. Norms, the router, the latent expert projections, the Block-AttnRes
  mixers, the embedding, the output head and the vision path are replicated (the vocabulary projections are
  one layer's worth of a 61-layer model; splitting them by vocabulary is left for later).
KDA's A_log is stored padded to 128 entries; every rank keeps it and reads its heads' entries.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..checkpoint.manifest import checkpoint_manifest, resolve_config
from ..config import ModelConfig
from ..formats.dtypes import memory_dtype

COLUMN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight",
          "self_attn.f_b_proj.weight", "self_attn.b_proj.weight", "self_attn.g_proj.weight", "self_attn.dt_bias",
          "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight",
          "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")
ROW = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight")
EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Parallelism:
    """How one model is split over ``world`` processes."""

    tp: int = 1  # tensor-parallel degree: attention heads, the shared expert and the dense MLP
    ep: int = 1  # expert-parallel degree: routed experts

    def __post_init__(self) -> None:
        for name in ("tp", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if max(self.tp, self.ep) % min(self.tp, self.ep):
            raise ValueError(f"tp={self.tp}, ep={self.ep}: the larger must be a multiple of the smaller "
                             f"(ranks = the larger; e.g. --tp 8 --ep 64)")

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def check(self, cfg: ModelConfig) -> None:
        """ValueError naming the fix when a size does not split evenly."""
        splits = {"kda.num_heads": cfg.kda.num_heads, "mla.num_heads": cfg.mla.num_heads,
                  "moe.shared_intermediate_size": cfg.moe.shared_intermediate_size,
                  "dense_intermediate_size": cfg.dense_intermediate_size}
        for name, n in splits.items():
            if n % self.tp:
                good = [t for t in range(1, n + 1) if n % t == 0 and t <= 64]
                raise ValueError(f"tp={self.tp} does not divide {name}={n}; use a tp from {good}")
        if cfg.moe.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide moe.num_experts={cfg.moe.num_experts}; use a divisor "
                             f"of {cfg.moe.num_experts}")

    def expert_range(self, cfg: ModelConfig, rank: int) -> range:
        """The routed experts rank ``rank`` owns: a contiguous range."""
        n = cfg.moe.num_experts // self.ep
        return range(self.ep_rank(rank) * n, (self.ep_rank(rank) + 1) * n)


def _suffix(name: str) -> str:
    return name.split(".layers.", 1)[-1].split(".", 1)[-1] if ".layers." in name else name


def tensor_slice(name: str, shape: tuple[int, ...], par: Parallelism, rank: int,
                 cfg: ModelConfig) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor ``name`` (full ``shape``) that ``rank`` holds: a slice per dim, or None
    when the rank holds none of it (another rank's routed expert)."""
    whole = tuple(slice(0, n) for n in shape)
    m = EXPERT.search(name)
    if m:
        return whole if int(m.group(1)) in par.expert_range(cfg, rank) else None
    suffix = _suffix(name)
    for kinds, dim in ((COLUMN, 0), (ROW, 1)):
        if name.startswith("language_model.") and suffix.endswith(kinds):
            n = shape[dim] // par.tp
            t = par.tp_rank(rank)
            return whole[:dim] + (slice(t * n, (t + 1) * n),) + whole[dim + 1:]
    return whole


def shard_manifest(config, tp: int = 1, ep: int = 1) -> dict[int, dict[str, list[list[int]]]]:
    """{rank: {checkpoint name: [[start, stop] per dim]}} for every tensor the rank holds (JSON-ready)."""
    cfg = resolve_config(config)
    par = Parallelism(tp, ep)
    par.check(cfg)
    tensors = checkpoint_manifest(cfg)
    out = {}
    for rank in range(par.world):
        held = {}
        for name, (shape, _) in tensors.items():
            s = tensor_slice(name, shape, par, rank, cfg)
            if s is not None:
                held[name] = [[x.start, x.stop] for x in s]
        out[rank] = held
    return out


def rank_bytes(config, tp: int = 1, ep: int = 1) -> list[dict[str, int]]:
    """Per rank: resident bytes of weights (``experts`` of them routed experts, MXFP4), KV bytes per token,
    KDA state bytes per sequence, and the FP8 expert workspace (sized by the rank's own experts)."""
    cfg = resolve_config(config)
    par = Parallelism(tp, ep)
    par.check(cfg)
    tensors = checkpoint_manifest(cfg)
    dtype = cfg.torch_dtype
    esize = lambda name, disk: (1 if disk == "U8" else torch.empty((), dtype=memory_dtype(name, dtype)).element_size())  # noqa: E731
    kv_tok = _kv_bytes_per_token(cfg)
    W = cfg.kda.conv_size
    HK = cfg.kda.num_heads * cfg.kda.head_dim
    state = len(cfg.kda_layers) * 4 * (cfg.kda.num_heads // par.tp * cfg.kda.head_dim ** 2 + (W - 1) * 3 * HK // par.tp)
    per_expert_fp8 = 3 * cfg.moe.latent_size * cfg.moe.expert_intermediate_size * 33 // 32
    shared, experts = 0, [0] * cfg.moe.num_experts  # bytes every rank holds; bytes of each routed expert
    for name, (shape, disk) in tensors.items():
        m = EXPERT.search(name)
        if m:
            experts[int(m.group(1))] += math.prod(shape)  # packed codes and scales: one byte each
        else:  # TP slices are even, so every TP rank holds as many bytes as rank 0
            s = tensor_slice(name, shape, par, 0, cfg)
            shared += math.prod(x.stop - x.start for x in s) * esize(name, disk)
    rows = []
    for rank in range(par.world):
        mine = par.expert_range(cfg, rank)
        routed = sum(experts[e] for e in mine)
        rows.append({"rank": rank, "weights": shared + routed, "experts": routed, "kv_per_token": kv_tok,
                     "kda_state_per_sequence": state,
                     "workspace": min(cfg.moe.workspace_experts, len(mine)) * per_expert_fp8})
    return rows


def _kv_bytes_per_token(cfg: ModelConfig) -> int:
    """MLA latent rows and indexer keys of one token over all MLA layers: the same on every TP rank."""
    elt = torch.empty((), dtype=cfg.torch_dtype).element_size()
    key = cfg.indexer.head_dim * (1 if cfg.indexer.fp8 else elt) + (4 if cfg.indexer.fp8 else 0)
    return len(cfg.mla_layers) * ((cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * elt + key)
