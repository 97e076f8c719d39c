"""Plots of what the model did, from a GenerationTrace: which keys DSA selected, and how the Block
AttnRes mixers weighted depth. Each function returns a matplotlib Figure (nothing is shown or saved).
"""

from __future__ import annotations

import numpy as np
import torch

from ..model.trace import GenerationTrace


def selection_matrix(trace: GenerationTrace, layer: int) -> np.ndarray:
    """[queries, keys] array: 1 where the query at row t selected key s in MLA layer ``layer``, else 0."""
    if layer not in trace.selected:
        raise ValueError(f"layer {layer} is not an MLA layer of this trace; MLA layers: {sorted(trace.selected)}")
    sel = trace.selected[layer].long()
    n = len(trace.token_ids)
    m = torch.zeros(sel.shape[0], n + 1)
    m.scatter_(1, torch.where(sel >= 0, sel, torch.full_like(sel, n)), 1.0)  # -1 lands in the dropped column
    return m[:, :n].numpy()


def plot_selection(trace: GenerationTrace, layer: int, ax=None):
    """Query position (rows) vs key position (columns): selected keys in dark, image keys in orange,
    the causal boundary as a line, the prompt/generation boundary dashed."""
    import matplotlib.pyplot as plt

    m = selection_matrix(trace, layer)
    fig = ax.figure if ax is not None else plt.figure(figsize=(6, 5))
    ax = ax or fig.add_subplot()
    rgb = np.ones(m.shape + (3,))
    rgb[m > 0] = (0.1, 0.2, 0.5)
    if trace.image_positions:
        img = np.zeros(m.shape[1], dtype=bool)
        img[trace.image_positions] = True
        rgb[(m > 0) & img[None, :]] = (0.95, 0.55, 0.1)
    ax.imshow(rgb, interpolation="nearest", aspect="auto")
    n = m.shape[0]
    ax.plot([-0.5, n - 0.5], [-0.5, n - 0.5], color="0.6", lw=0.8)
    ax.axhline(trace.prompt_len - 0.5, color="0.3", ls="--", lw=0.8)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(f"DSA top-{trace.selected[layer].shape[1]} selection, MLA layer {layer}")
    fig.tight_layout()
    return fig


def depth_weight_matrix(trace: GenerationTrace) -> tuple[list[str], np.ndarray]:
    """Mixer names and [mixers, max_sources] mean weights over tokens (NaN where a mixer has fewer sources)."""
    names = list(trace.depth_weights)
    if not names:
        raise ValueError("this trace has no AttnRes depth weights (generate with return_trace=True)")
    width = max(w.shape[1] for w in trace.depth_weights.values())
    out = np.full((len(names), width), np.nan)
    for i, name in enumerate(names):
        w = trace.depth_weights[name].mean(0).numpy()
        out[i, : w.shape[0]] = w
    return names, out


def plot_depth_weights(trace: GenerationTrace, ax=None):
    """Each mixer (row) against its sources (columns: embedding, stored blocks, then the partial sum)."""
    import matplotlib.pyplot as plt

    names, m = depth_weight_matrix(trace)
    fig = ax.figure if ax is not None else plt.figure(figsize=(5, 0.22 * len(names) + 1.5))
    ax = ax or fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(m), cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("source (0 = embedding block; a row's last = its partial sum)")
    ax.set_title("Block AttnRes depth weights\n(mean over tokens)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig
