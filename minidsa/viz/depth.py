"""Pictures of Block Attention Residuals: how each depth mixer weighted the blocks below it (docs/design.md §1).

Instead of adding every layer's output into one residual stream, the decoder stores one summed output per
block of layers (the embedding is block 0) and each mixer ("{layer}.attn", "{layer}.ffn", and "out" before
the head) forms its input as a softmax-weighted mix of the stored blocks plus the running sum of the current
block (the "partial"). ``plot_depth_weights`` draws those softmax weights, averaged over the tokens of a
``GenerationTrace``: one row per mixer, one column per source ("emb", "b1", "b2", ..., "partial"), so a row
that puts its weight on "emb" is reading the token embedding straight, and one on "partial" acts like a
plain residual. Cells a mixer cannot see (blocks not yet written at its depth) are left grey.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from ..model.trace import GenerationTrace

MISSING = (0.88, 0.88, 0.88)


def depth_weight_matrix(trace: GenerationTrace) -> tuple[list[str], np.ndarray]:
    """Mixer names and [mixers, max_sources] mean weights over tokens (NaN where a mixer has fewer sources)."""
    names = list(trace.depth_weights)
    if not names:
        raise ValueError("this trace has no AttnRes depth weights (generate with trace=True)")
    width = max(w.shape[1] for w in trace.depth_weights.values())
    out = np.full((len(names), width), np.nan)
    for i, name in enumerate(names):
        w = trace.depth_weights[name].mean(0).numpy()
        out[i, : w.shape[0]] = w
    return names, out


def source_names(width: int) -> list[str]:
    """Names of the columns of ``plot_depth_weights`` for mixers of at most ``width`` sources:
    "emb", "b1", ..., "b{width - 2}", "partial"."""
    return ["emb"] + [f"b{j}" for j in range(1, width - 1)] + ["partial"]


def _by_source(names: list[str], m: np.ndarray, trace: GenerationTrace) -> np.ndarray:
    """Realign ``depth_weight_matrix`` rows so each mixer's last source (its partial sum) sits in the last
    column and its stored blocks in columns 0.. (NaN in between)."""
    out = np.full_like(m, np.nan)
    for i, name in enumerate(names):
        n = trace.depth_weights[name].shape[1]
        out[i, : n - 1] = m[i, : n - 1]
        out[i, -1] = m[i, n - 1]
    return out


def plot_depth_weights(trace: GenerationTrace, *, mixers=None, ax=None):
    """Mixers (rows, in depth order; ``mixers`` picks some by name) against their sources (integer columns named
    "emb", "b1", ..., "partial"): the mean softmax weight over the trace's tokens, printed in each cell when
    the grid is small, with a colour bar. Returns the Figure."""
    names, m = depth_weight_matrix(trace)
    m = _by_source(names, m, trace)
    if mixers is not None:
        wanted = list(mixers)
        unknown = [n for n in wanted if n not in names]
        if unknown or not wanted:
            raise ValueError(f"unknown mixers {unknown or wanted}; this trace's mixers: {names}")
        m = m[[names.index(n) for n in wanted]]
        names = wanted
    own = ax is None
    fig = plt.figure(figsize=(2.5 + 0.55 * m.shape[1], 1.4 + 0.24 * len(names))) if own else ax.figure
    ax = ax or fig.add_subplot()
    cmap = plt.get_cmap("viridis").with_extremes(bad=MISSING)
    im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(m.shape[1]), source_names(m.shape[1]), fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=7, family="monospace")
    if m.size <= 400:
        for (i, j), v in np.ndenumerate(m):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="black" if v > 0.6 else "white")
    ax.set_xlabel("source (emb = embedding, bN = stored block N,\npartial = the current block's running sum)", fontsize=8)
    ax.set_ylabel("mixer (layer.attn / layer.ffn / out)", fontsize=8)
    n_tokens = next(iter(trace.depth_weights.values())).shape[0]
    ax.set_title(f"Block AttnRes depth weights\n(mean over {n_tokens} tokens)", fontsize=10)
    fig.colorbar(im, ax=ax, label="softmax weight", pad=0.03, shrink=0.75, anchor=(0.0, 1.0))
    if np.isnan(m).any():
        ax.legend(handles=[Patch(color=MISSING, label="no such source\nat this depth")], loc="lower left",
                  bbox_to_anchor=(1.02, 0.0), fontsize=7, frameon=False, borderaxespad=0)
    if own:
        fig.tight_layout()
    return fig
