"""Pictures of the latent mixture of experts (docs/design.md §6, §7): where tokens are routed and what the
routed experts cost in memory.

- ``plot_expert_load``: tokens routed to each expert in each MoE layer (a heat map). A learner sees
  whether routing is balanced (the selection bias of DeepSeek-V3's aux-loss-free balancing exists to
  keep it so) or whether a few experts take most tokens.
- ``plot_routed_experts``: for a few chosen tokens, which top-k experts each goes to in every MoE layer,
  marker size = routing weight: routing is per token and per layer, and different tokens share experts.
- ``plot_workspace``: the routed experts stored as MXFP4 against the same experts in FP8 or bf16, and
  the one FP8 workspace that every MoE layer converts its routed experts into before computing: its
  capacity and how much of it the last forward filled. This is why run-time expert memory does not
  grow with depth.

``expert_load`` returns the counts behind the first picture.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from ..formats import mxfp4
from ..model.minidsa import MiniDSA
from ._common import as_batch, bytes_axis, human_bytes, integer_axis, new_axes
from .tokens import find_span, token_labels


def moe_layer_indices(model: MiniDSA) -> list[int]:
    """Decoder layer index of each MoE layer, in order."""
    return [i for i, layer in enumerate(model.language_model.model.layers) if layer.is_moe]


@torch.no_grad()
def expert_routing(model: MiniDSA, token_ids) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per MoE layer: (expert ids int [T, top_k], routing weights [T, top_k]) of one no-cache forward; a hook
    takes each MoE layer's input and the layer's own router (``LatentMoE.route``) decides, as in the forward."""
    seen: dict[int, torch.Tensor] = {}
    moes = model.moe_layers()
    handles = [moe.register_forward_pre_hook(lambda _m, args, i=i: seen.setdefault(i, args[0]))
               for i, moe in enumerate(moes)]
    try:
        model(as_batch(model, token_ids))
    finally:
        for h in handles:
            h.remove()
    out = []
    for i, moe in enumerate(moes):
        ids, weights = moe.route(seen[i].reshape(-1, seen[i].shape[-1]))
        out.append((ids.cpu().numpy(), weights.float().cpu().numpy()))
    return out


def expert_load(model: MiniDSA, token_ids) -> np.ndarray:
    """int64 [moe_layers, num_experts]: tokens routed to each expert (each row sums to tokens x top_k)."""
    E = model.config.moe.num_experts
    return np.stack([np.bincount(ids.reshape(-1), minlength=E) for ids, _ in expert_routing(model, token_ids)])


def plot_expert_load(model: MiniDSA, token_ids, *, ax=None):
    """Heat map of ``expert_load``: MoE layers (rows) x experts (columns), counts written in the cells."""
    load = expert_load(model, token_ids)
    layers = moe_layer_indices(model)
    fig, ax = new_axes(ax, (max(5.0, 0.45 * load.shape[1] + 2), max(3.0, 0.4 * load.shape[0] + 1.5)))
    im = ax.imshow(load, cmap="Blues", aspect="auto", vmin=0)
    if load.size <= 400:
        for (r, c), n in np.ndenumerate(load):
            ax.text(c, r, str(n), ha="center", va="center", fontsize=7,
                    color="white" if n > 0.6 * load.max() else "black")
    ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers])
    if load.shape[1] <= 32:
        ax.set_xticks(range(load.shape[1]))
    else:
        integer_axis(ax, "x")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer (decoder index)")
    T, k = int(load[0].sum()) // model.config.moe.top_k, model.config.moe.top_k
    ax.set_title(f"Tokens routed to each expert ({T} tokens x top-{k}; uniform = {T * k / load.shape[1]:.1f})")
    fig.colorbar(im, ax=ax, label="tokens")
    fig.tight_layout()
    return fig


def _positions(ids: list[int], positions) -> list[int]:
    """Positions as a list of ints: an int, an iterable of ints (negative counts from the end) or a str
    (the positions spelling it, via ``find_span``)."""
    if isinstance(positions, str):
        return list(find_span(ids, positions))
    positions = [positions] if isinstance(positions, (int, np.integer)) else list(positions)
    out = [int(p) + len(ids) if int(p) < 0 else int(p) for p in positions]
    bad = [p for p in out if not 0 <= p < len(ids)]
    if bad or not out:
        raise ValueError(f"positions {positions!r} must name tokens in [0, {len(ids)})")
    return out


def plot_routed_experts(model: MiniDSA, token_ids, positions, *, ax=None):
    """For each chosen token (one colour each), its top-k experts (y) in every MoE layer (x); marker area =
    routing weight. ``positions``: an int, a list/range of positions or a substring of the text."""
    ids = as_batch(model, token_ids)[0].tolist()
    pos = _positions(ids, positions)
    routing = expert_routing(model, token_ids)
    labels = token_labels(ids)
    fig, ax = new_axes(ax, (max(5.0, 0.9 * len(routing) + 2), 4.5))
    colours = plt.get_cmap("tab10")(np.arange(len(pos)) % 10)
    width = 0.6 / max(1, len(pos))
    for j, p in enumerate(pos):
        x = np.arange(len(routing)) + (j - (len(pos) - 1) / 2) * width
        for layer, (eids, w) in enumerate(routing):
            ax.scatter(np.full(eids.shape[1], x[layer]), eids[p], s=40 + 160 * w[p] / w[p].max(), color=colours[j],
                       edgecolor="black", lw=0.4, label=f"token {p} '{labels[p]}'" if layer == 0 else None)
    ax.set_xticks(range(len(routing)), [f"layer {i}" for i in moe_layer_indices(model)])
    E = model.config.moe.num_experts
    ax.set_ylim(-0.5, E - 0.5)
    if E <= 32:
        ax.set_yticks(range(E))
    else:
        integer_axis(ax, "y")
    ax.set_ylabel("expert")
    ax.set_xlabel("MoE layer (decoder index)")
    ax.set_title(f"Top-{model.config.moe.top_k} routed experts per token (marker size = routing weight)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def workspace_bytes(model: MiniDSA) -> dict[str, float]:
    """Bytes of the routed experts as stored (MXFP4: codes + E8M0 scales), in FP8 (elements + the same
    scales: offline mode), in bf16; the FP8 workspace's capacity; and, for the last forward, the mean number
    of workspace slots filled per MoE layer ("slots_last_forward") of "capacity_experts"."""
    stats, moe, layers = model.expert_stats(), model.config.moe, max(1, len(model.moe_layers()))
    elements = stats["expert_bytes_bf16"] // 2
    per_expert = 3 * moe.latent_size * moe.expert_intermediate_size * (1 + 1 / mxfp4.GROUP)
    return {"mxfp4": float(stats["expert_bytes_mxfp4"]), "fp8": elements * (1 + 1 / mxfp4.GROUP),
            "bf16": float(stats["expert_bytes_bf16"]), "workspace": moe.workspace_experts * per_expert,
            "workspace_used": min(stats["conversions_last_forward"] / layers, moe.workspace_experts) * per_expert,
            "slots_last_forward": stats["conversions_last_forward"] / layers,
            "capacity_experts": float(moe.workspace_experts), "offline_fp8": float(stats["offline_fp8_bytes"])}


def plot_workspace(model: MiniDSA, *, token_ids=None, ax=None):
    """Horizontal bars (bytes, labelled): the routed experts of every layer in MXFP4 / FP8 / bf16, and the one
    shared FP8 workspace (capacity, and what the last forward filled per layer). ``token_ids``: run one
    no-cache forward of them first (otherwise the model's last forward counts)."""
    if token_ids is not None:
        with torch.no_grad():
            model(as_batch(model, token_ids))
    b = workspace_bytes(model)
    L, cap = len(model.moe_layers()), int(b["capacity_experts"])
    bars = [(f"routed experts in MXFP4 (stored, {L} layers)", b["mxfp4"]),
            ("in FP8 + E8M0 scales (offline mode)", b["fp8"]),
            ("in bf16", b["bf16"]),
            (f"FP8 workspace: {cap} experts (shared)", b["workspace"]),
            (f"last forward: {b['slots_last_forward']:.1f} of {cap} slots/layer", b["workspace_used"])]
    fig, ax = new_axes(ax, (8.5, 3.6))
    y = np.arange(len(bars))[::-1]
    ax.barh(y[:3], [v for _, v in bars[:3]], color="tab:blue", label="stored experts (whole model)")
    ax.barh(y[3:], [v for _, v in bars[3:]], color="tab:orange", label="run-time FP8 workspace")
    for yi, (_, v) in zip(y, bars):
        ax.text(v, yi, " " + human_bytes(v), va="center", fontsize=8)
    ax.set_yticks(y, [name for name, _ in bars], fontsize=8)
    ax.set_xlim(0, 1.25 * max(v for _, v in bars))
    bytes_axis(ax, "x")
    ax.set_title(f"Routed-expert memory of {model.config.name}:\nstored formats vs the one shared FP8 workspace")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


__all__ = ["expert_load", "expert_routing", "plot_expert_load", "plot_routed_experts", "plot_workspace",
           "workspace_bytes"]
