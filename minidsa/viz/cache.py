"""A picture of the paged KV cache (docs/design.md §3): one pool of fixed-size blocks shared by every
sequence, and each sequence's block table mapping its logical blocks to physical ones.

``plot_block_tables`` draws the pool as a row of physical blocks coloured by the sequence that owns
them (with the valid tokens in each), and below it one row per sequence: its logical blocks in order,
each with an arrow to the physical block that holds it. A learner sees that a sequence's blocks need not
be contiguous or in order (freed blocks are reused by whoever asks next), that only the last block of a
sequence is partly filled, and that token ``pos`` lives in block ``table[pos // block_size]``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from ..cache import PagedKVCache
from ._common import new_axes

FREE_COLOUR = "0.9"
PHYSICAL_Y = 0.0  # the pool row; sequence i's table row sits at -(i + 1) * ROW_GAP
ROW_GAP = 1.6


def _shown_blocks(cache: PagedKVCache, max_blocks: int | None) -> int:
    """How many physical blocks (ids 0..n-1) to draw: all up to 64, else the used ones and a few free ones."""
    n = cache.layout.num_blocks
    if max_blocks is not None:
        return max(1, min(n, max_blocks))
    if n <= 64:
        return n
    used = [b for b, owner in enumerate(cache.block_owner) if owner >= 0]
    return min(n, (max(used) + 1 if used else 0) + 4)


def _cell(ax, x: float, y: float, colour, text: str, edge="black") -> None:
    ax.add_patch(Rectangle((x - 0.45, y - 0.4), 0.9, 0.8, facecolor=colour, edgecolor=edge, lw=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=6)


def plot_block_tables(cache: PagedKVCache, *, max_blocks: int | None = None, ax=None):
    """Physical blocks (columns of the top row) coloured by owning sequence, "tokens/block_size" written in
    each; one row per sequence with its logical blocks and an arrow from each to its physical block."""
    sids = cache.sequences()
    shown = _shown_blocks(cache, max_blocks)
    width = max([shown] + [len(cache.block_table(s)) for s in sids])
    fig, ax = new_axes(ax, (max(6.0, 0.32 * width + 2.5), 1.6 + 0.75 * (len(sids) + 1)))
    colours = {sid: plt.get_cmap("tab10")(i % 10) for i, sid in enumerate(sids)}
    for b in range(shown):
        owner = cache.block_owner[b]
        _cell(ax, b, PHYSICAL_Y, colours.get(owner, FREE_COLOUR), f"{cache.block_tokens[b]}/{cache.block_size}")
    for i, sid in enumerate(sids):
        y = -(i + 1) * ROW_GAP
        for j, b in enumerate(cache.block_table(sid)):
            _cell(ax, j, y, "white", str(b), edge=colours[sid])
            if b < shown:
                ax.annotate("", xy=(b, PHYSICAL_Y - 0.42), xytext=(j, y + 0.42),
                            arrowprops=dict(arrowstyle="->", color=colours[sid], lw=0.8, alpha=0.8))
    ax.set_xlim(-0.7, width - 0.3)
    ax.set_ylim(-len(sids) * ROW_GAP - 0.7, 0.7)
    ax.set_xticks(range(width))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_yticks([PHYSICAL_Y] + [-(i + 1) * ROW_GAP for i in range(len(sids))],
                  ["physical blocks"] + [f"seq {sid} table" for sid in sids])
    ax.set_xlabel("block index: physical (top row) or logical (table rows: each cell names its physical block)")
    handles = [Patch(facecolor=colours[s], label=f"seq {s}: {cache.seq_len(s)} tokens, {len(cache.block_table(s))} "
                     f"blocks") for s in sids] + [Patch(facecolor=FREE_COLOUR, edgecolor="black", label="free block")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    part = "" if shown == cache.layout.num_blocks else f", blocks 0-{shown - 1} shown"
    ax.set_title(f"Paged KV cache: {cache.layout.num_blocks} blocks of {cache.block_size} tokens, "
                 f"{cache.num_free_blocks} free{part}")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


__all__ = ["plot_block_tables"]
