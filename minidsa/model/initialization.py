"""Seeded initialisation of a fresh model: the same weights on every machine for a given config seed.

N(0, init_std) matrices, unit norm weights, zero biases and zero AttnRes pseudo-queries (a fresh
model averages its sources, docs/design.md §1), spread KDA decays, and routed experts drawn the same
way and stored in MXFP4.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .moe import LatentMoE


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """Fill every parameter (and every MoE layer's packed experts) of ``model`` from ``cfg.seed``."""
    g = torch.Generator().manual_seed(cfg.seed)
    for name, p in model.named_parameters():
        if name.endswith(("bias", "res_proj.weight", "A_log")):
            p.zero_()  # A_log = 0: the decay rate multiplier exp(A_log) starts at 1
        elif name.endswith("dt_bias"):
            # Spread the initial KDA decays: g = lb * sigmoid(dt_bias) ranges from ~lb/400 (long
            # memory) to lb/2 (short) across channels.
            p.copy_(torch.rand(p.shape, generator=g, device="cpu") * 6.0 - 6.0)
        elif name.endswith("conv1d.weight"):
            bound = p.shape[-1] ** -0.5  # PyTorch's default for a depthwise conv (fan_in = kernel)
            p.copy_(torch.rand(p.shape, generator=g, device="cpu") * 2 * bound - bound)
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=g, device="cpu") * cfg.init_std)
    for module in model.modules():
        if isinstance(module, LatentMoE):
            module.experts.init_seeded(g, cfg.init_std)
