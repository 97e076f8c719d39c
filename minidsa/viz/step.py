"""One packed engine step drawn: the token axis (decode rows first, then the prefill pieces), and per piece
its sequence, positions, KV blocks and KDA state slot (docs/design.md §16)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..cache import StepContext
from ._common import new_axes


def step_table(step: StepContext) -> list[dict]:
    """One dict per piece: sequence, kind ("decode"/"prefill"), token range on the axis, positions, block
    table and KDA state slot (host values, for printing and asserting)."""
    rows = []
    tables = step.block_table.cpu().tolist()
    slots = step.state_slots.cpu().tolist()
    for i, sid in enumerate(step.seq_ids):
        a, b = step.span(i)
        r = step.rows[i]
        rows.append({"piece": i, "seq": sid, "kind": "decode" if r < step.num_decode else "prefill",
                     "tokens": (a, b), "positions": (step.starts[i], step.starts[i] + b - a),
                     "blocks": [x for x in tables[r] if x >= 0], "state_slot": slots[r]})
    return rows


def plot_packed_step(step: StepContext, *, ax=None):
    """The step's token axis, one cell per token coloured by piece (decode rows hatched), each piece labelled
    with its sequence, positions, blocks and state slot."""
    n = step.num_tokens
    fig, ax = new_axes(ax, (max(7.0, 0.16 * n + 3), 2.6))
    colours = plt.get_cmap("tab10")
    handles = []
    for row in step_table(step):
        i, (a, b) = row["piece"], row["tokens"]
        decode = row["kind"] == "decode"
        for t in range(a, b):
            ax.add_patch(plt.Rectangle((t, 0), 1, 1, facecolor=colours(i % 10), edgecolor="white",
                                       hatch="//" if decode else None, alpha=0.85))
        lo, hi = row["positions"]
        handles.append(Patch(facecolor=colours(i % 10), hatch="//" if decode else None,
                             label=f"piece {i}: seq {row['seq']} {row['kind']}, positions {lo}-{hi - 1}, "
                                   f"blocks {row['blocks']}, state slot {row['state_slot']}"))
        if not decode:
            ax.text((a + b) / 2, 0.5, f"seq {row['seq']}", ha="center", va="center", fontsize=8)
    ax.axvline(step.query_start[step.num_decode], color="black", lw=1.5)
    ax.set_xlim(0, n)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xticks(step.query_start)
    ax.set_xlabel("token axis of the step's one forward (ticks: query_start); left of the black line: decode rows")
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.3), ncol=1)
    k = step.num_pieces - step.decode_pieces
    ax.set_title(f"One packed step: {step.num_decode} decode rows, {k} prefill piece{'s' * (k != 1)}, {n} tokens")
    return fig
