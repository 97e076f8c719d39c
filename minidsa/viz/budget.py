"""The memory budget of serving a model (docs/design.md §3, §6, §7), computed from its config on the meta
device, so it works at reference scale ("k3.1-pro") without any memory.

``memory_budget`` adds up, in bytes: the weights with the routed experts in MXFP4 (as shipped), in FP8 or
in bf16 (the rest of the weights in their in-memory dtype: bf16, with norms, gates and the router in fp32);
what one sequence of ``context`` tokens needs (the MLA KV cache, the indexer keys and the KDA states, from
the model's ``CacheLayout``); and the one shared FP8 expert workspace. ``plot_memory_budget`` draws them as
labelled bars (GB). A learner sees what dominates: the routed experts (which MXFP4 halves against FP8),
then the per-sequence cache, where KDA's constant state is small next to the linear KV cache at 1M tokens.
"""

from __future__ import annotations

import numpy as np

from ._common import bytes_axis, human_bytes, meta_model, new_axes
from .kda import state_memory
from .mxfp4 import expert_format_bytes

_EXPERT_BUFFERS = ("experts.packed", "experts.scales")


def memory_budget(config="k3.1-pro", context: int = 1_000_000) -> dict[str, float]:
    """Bytes of the model's memory at ``context`` tokens for one sequence (see the module doc):
    weights_{mxfp4,fp8,bf16}_experts, routed_experts_{mxfp4,fp8,bf16}, other_weights, kv_cache (MLA latent +
    k_pe), indexer_keys, kda_state, per_sequence (the three), fp8_workspace, and total (MXFP4 weights +
    workspace + one sequence)."""
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 0:
        raise ValueError(f"context = {context!r} must be an int >= 0 (tokens)")
    model = meta_model(config)
    experts = expert_format_bytes(config)
    other = sum(p.numel() * p.element_size() for p in model.parameters())
    other += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if not n.endswith(_EXPERT_BUFFERS))
    seq = {k: float(v[0]) for k, v in state_memory(config, (int(context),)).items() if k != "context"}
    out = {f"weights_{f}_experts": other + experts[f] for f in ("mxfp4", "fp8", "bf16")}
    out |= {f"routed_experts_{f}": experts[f] for f in ("mxfp4", "fp8", "bf16")}
    out |= {"other_weights": float(other), **seq, "per_sequence": sum(seq.values()),
            "fp8_workspace": float(model.expert_workspace().nbytes)}
    out["total"] = out["weights_mxfp4_experts"] + out["fp8_workspace"] + out["per_sequence"]
    return {k: float(v) for k, v in out.items()}


def _context_label(context: int) -> str:
    for suffix, size in (("M", 1_000_000), ("k", 1_000)):
        if context >= size and context % size == 0:
            return f"{context // size}{suffix}"
    return f"{context:,}"


def plot_memory_budget(config="k3.1-pro", context: int = 1_000_000, *, log: bool = True, ax=None):
    """Horizontal bars of ``memory_budget`` labelled in GB, coloured by kind: weights, one sequence's cache,
    the run-time expert workspace and the total (log bytes axis by default: the parts span 4 decades)."""
    b = memory_budget(config, context)
    ctx = _context_label(int(context))
    bars = [("weights, routed experts MXFP4 (as shipped)", b["weights_mxfp4_experts"], "weights"),
            ("weights, routed experts FP8", b["weights_fp8_experts"], "weights"),
            ("weights, routed experts bf16", b["weights_bf16_experts"], "weights"),
            (f"MLA KV cache (c_kv + k_pe), {ctx} tokens", b["kv_cache"], "sequence"),
            (f"DSA indexer keys (fp8 k_I + scale), {ctx} tokens", b["indexer_keys"], "sequence"),
            ("KDA states (recurrent + conv), any length", b["kda_state"], "sequence"),
            (f"one sequence at {ctx} tokens (sum of the three)", b["per_sequence"], "sequence"),
            ("shared FP8 expert workspace", b["fp8_workspace"], "workspace"),
            ("total: MXFP4 weights + workspace + one sequence", b["total"], "total")]
    kinds = {"weights": ("tab:blue", "weights"), "sequence": ("tab:green", f"per-sequence cache at {ctx} tokens"),
             "workspace": ("tab:orange", "run-time workspace"), "total": ("0.35", "total")}
    fig, ax = new_axes(ax, (9, 4.8))
    y = np.arange(len(bars))[::-1]
    for kind, (colour, label) in kinds.items():
        rows = [(yi, v) for yi, (_, v, k) in zip(y, bars) if k == kind]
        ax.barh([r[0] for r in rows], [r[1] for r in rows], color=colour, label=label)
    for yi, (_, v, _) in zip(y, bars):
        ax.text(v, yi, " " + human_bytes(v, "GB"), va="center", fontsize=8)
    ax.set_yticks(y, [name for name, _, _ in bars], fontsize=8)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(min(v for _, v, _ in bars) / 3, max(v for _, v, _ in bars) * 8)
    else:
        ax.set_xlim(0, max(v for _, v, _ in bars) * 1.2)
    bytes_axis(ax, "x", "bytes" + (" (log scale)" if log else "") + ", in GB (10^9 B)", unit="GB")
    ax.set_title(f"{meta_model(config).config.name}: memory to serve one sequence of {ctx} tokens")
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3, axis="x", which="both")
    fig.tight_layout()
    return fig


__all__ = ["memory_budget", "plot_memory_budget"]
