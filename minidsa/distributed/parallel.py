"""One rank's part of the model: its slices of the weights, and the all-reduces that make its sub-layers whole.

``shard_model(read, cfg, par, rank, comm)`` builds the rank-local model of ``cfg`` under ``par`` (plan.py):
a ``MiniDSA`` of a local config (tp-th of the KDA and MLA heads, of the shared expert's and the dense MLP's
width), its routed experts only ``par.expert_range(rank)``, filled by ``read(name, slices)`` with the plan's
slice of each checkpoint tensor. ``Comm`` carries the two process groups. Four sub-layers produce partial
sums, and each ends in one all-reduce:
- KDA and MLA attention: the row-parallel ``o_proj`` (over the TP group);
- the dense MLP and the shared expert: the row-parallel ``down_proj`` (TP group);
- the routed experts: each rank's experts' latent sum, before ``routed_expert_norm`` (EP group; the norm is
  nonlinear, so the sum must be whole first). Every rank holds every token (the batch is the same on all
  ranks), so dispatch is each rank picking its own experts' pairs and combine is this all-reduce: the
  all-gather + reduce-scatter of an all-to-all scheme, with nothing to scatter since every rank needs
  every token's result.
The all-reduce is an all-gather summed in rank order, so every rank gets the same bits and runs repeat.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..model.minidsa import MiniDSA
from .failures import naming_lost_peers
from .plan import Parallelism, tensor_slice


class Comm:
    """This rank's TP and EP groups (ranks and process group), made once per process, in the same order on
    every rank (``dist.new_group`` is collective). Without torch.distributed (world 1) reductions are no-ops."""

    def __init__(self, par: Parallelism, rank: int) -> None:
        self.par, self.rank = par, rank
        self.tp_ranks = [rank // par.tp * par.tp + i for i in range(par.tp)]
        self.ep_ranks = [rank // par.ep * par.ep + i for i in range(par.ep)]
        self._groups = {}
        if dist.is_available() and dist.is_initialized() and par.world > 1:
            for size in sorted({par.tp, par.ep}):
                for start in range(0, par.world, size):
                    ranks = list(range(start, start + size))
                    group = dist.new_group(ranks) if size > 1 else None
                    self._groups[tuple(ranks)] = group

    def _reduce(self, x: torch.Tensor, ranks: list[int], kind: str) -> torch.Tensor:
        if len(ranks) == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in ranks]
        with naming_lost_peers(f"in a {kind} all-reduce"):  # a peer that died: named, not gloo's address
            dist.all_gather(parts, x, group=self._groups[tuple(ranks)])
        out = parts[0]
        for p in parts[1:]:  # a fixed order: the same sum on every rank and in every run
            out = out + p
        return out

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, self.tp_ranks, "tensor-parallel")

    def ep_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, self.ep_ranks, "expert-parallel")


def local_config(cfg: ModelConfig, par: Parallelism) -> ModelConfig:
    """The config of one rank's model: a tp-th of the heads and intermediate widths, a workspace no larger
    than the rank's own experts (the router still scores all of them)."""
    par.check(cfg)
    t = par.tp
    return cfg.replace(
        dense_intermediate_size=cfg.dense_intermediate_size // t,
        kda=dataclasses.replace(cfg.kda, num_heads=cfg.kda.num_heads // t),
        mla=dataclasses.replace(cfg.mla, num_heads=cfg.mla.num_heads // t),
        moe=dataclasses.replace(cfg.moe, shared_intermediate_size=cfg.moe.shared_intermediate_size // t,
                                workspace_experts=min(cfg.moe.workspace_experts, cfg.moe.num_experts // par.ep)))


def shard_model(read: Callable[[str, tuple[slice, ...]], torch.Tensor], full_shapes: dict[str, tuple[int, ...]],
                cfg: ModelConfig, par: Parallelism, rank: int, comm: Comm, device="cpu") -> MiniDSA:
    """Rank ``rank``'s model, every tensor filled by ``read(name, slices)`` (the plan's slice of the full
    tensor ``full_shapes[name]``; it must come back in that shape)."""
    model = MiniDSA(local_config(cfg, par), device="meta", init=False)
    mine = par.expert_range(cfg, rank)
    for moe in model.moe_layers():  # on the meta device: memory is allocated for this rank's experts only
        moe.experts.keep(mine)
    model = model.to_empty(device=device)
    heads = cfg.kda.num_heads // par.tp
    h0 = par.tp_rank(rank) * heads
    for name, local in model.checkpoint_tensors().items():
        full = full_shapes[name]
        if name.endswith("self_attn.A_log"):  # padded per-head rates: this rank's heads first, zeros after
            whole = read(name, tuple(slice(0, n) for n in full))
            local.zero_()
            local[:heads] = whole[h0:h0 + heads]
            continue
        want = tensor_slice(name, full, par, rank, cfg)
        shape = tuple(s.stop - s.start for s in want)
        if shape != tuple(local.shape):
            raise ValueError(f"rank {rank}: {name} slice has shape {shape} but the local model expects "
                             f"{tuple(local.shape)}")
        with torch.no_grad():
            local.copy_(read(name, want))
    for layer in model.language_model.model.layers:
        layer.self_attn.parallel = comm
        if layer.is_moe:
            layer.block_sparse_moe.parallel = comm
            layer.block_sparse_moe.shared_experts.parallel = comm
        else:
            layer.mlp.parallel = comm
    model.parallelism = (par, rank)
    return model


def shard_from_model(full: MiniDSA, par: Parallelism, rank: int, comm: Comm) -> MiniDSA:
    """Rank ``rank``'s model cut from a whole one in memory (tests, notebooks)."""
    tensors = full.checkpoint_tensors()
    return shard_model(lambda name, s: tensors[name][s], {n: tuple(t.shape) for n, t in tensors.items()},
                       full.config, par, rank, comm, device=full.device)


