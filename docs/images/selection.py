"""Draw docs/images/selection.png: the keys that the shipped model's DSA indexer selected while it answered
the README's pass-key prompt.

    python docs/images/selection.py            # writes docs/images/selection.png next to this file

One MLA layer (layer 3 by default), one row per answer query: the query at the prompt's last position,
which predicts the first digit, then each generated digit fed back, which predicts the next token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

import minidsa  # noqa: E402
from minidsa.viz import selection_matrix  # noqa: E402

PROMPT = ("the river runs past old town where people walk slowly The pass key of kqz is 40271. "
          "birds sing of morning light on hills far away and the sky is blue\nQ: pass key of kqz?\nA: ")
PASS_KEY = "40271"
OUT = Path(__file__).resolve().with_name("selection.png")

SELECTED, IN_KEY, SPAN = (0.12, 0.22, 0.55), (0.85, 0.2, 0.1), (1.0, 0.93, 0.6)


def label(tok: minidsa.ByteTokenizer, token_id: int) -> str:
    """One token as a short label: its character, spaces and newlines made visible, specials named."""
    if token_id == tok.bos_id:
        return "bos"
    if token_id == tok.eos_id:
        return "eos"
    ch = tok.decode([token_id], skip_special=False)
    return {" ": "␣", "\n": "↵"}.get(ch, ch)


def panel(ax, rgb, chars, rows, lo, hi, every, span) -> None:
    """Key columns lo..hi-1 of the picture, labelled with every ``every``-th character (the span's in colour)."""
    ax.imshow(rgb[:, lo:hi], interpolation="nearest", aspect="auto",
              extent=(lo - 0.5, hi - 0.5, len(rows) - 0.5, -0.5))
    ticks = list(range(lo, hi, every))
    ax.set_xticks(ticks, [chars[t] for t in ticks], fontsize=7 if every > 1 else 9, family="monospace")
    for t, text in zip(ticks, ax.get_xticklabels()):
        if span[0] <= t < span[1]:
            text.set_color(IN_KEY)
            text.set_fontweight("bold")
    ax.set_yticks(range(len(rows)), [f"{chars[r]} → {chars[r + 1]}" for r in rows], fontsize=8, family="monospace")
    if every == 1:
        ax.set_xticks(np.arange(lo, hi) - 0.5, minor=True)
        ax.grid(which="minor", axis="x", color="0.85", lw=0.5)
        ax.tick_params(which="minor", length=0)


def draw(layer: int, every: int) -> Path:
    torch.set_num_threads(1)
    model = minidsa.load("default", progress=False)
    text, trace = minidsa.generate(PROMPT, model, temperature=0, max_new_tokens=8, return_trace=True,
                                   progress=False)
    tok = minidsa.ByteTokenizer()
    m = selection_matrix(trace, layer)
    rows = list(range(trace.prompt_len - 1, len(trace.token_ids) - 1))  # each query that produced a token
    n_keys = rows[-1] + 1  # the keys the last query could see
    chars = [label(tok, t) for t in trace.token_ids]
    key_lo = 1 + PROMPT.index(PASS_KEY)  # position 0 is bos; the byte tokenizer gives one token per character
    key_hi = key_lo + len(PASS_KEY)

    m = m[:, :n_keys]
    rgb = np.ones((len(rows), n_keys, 3))
    rgb[:, key_lo:key_hi] = SPAN
    picked = m[rows] > 0
    rgb[picked] = SELECTED
    in_key = np.zeros(n_keys, dtype=bool)
    in_key[key_lo:key_hi] = True
    rgb[picked & in_key[None, :]] = IN_KEY

    fig, (ax, zoom) = plt.subplots(2, 1, figsize=(9, 5), dpi=100, gridspec_kw={"height_ratios": [1, 1]})
    lo, hi = max(0, key_lo - 14), min(n_keys, key_hi + 14)
    panel(ax, rgb, chars, rows, 0, n_keys, every, (key_lo, key_hi))
    panel(zoom, rgb, chars, rows, lo, hi, 1, (key_lo, key_hi))
    ax.add_patch(Rectangle((lo - 0.5, -0.5), hi - lo, len(rows), fill=False, ec="0.3", lw=1, ls=":"))
    ax.set_xlabel(f"every key position, 0 = bos (every {every}th character shown; dotted: the zoom below)",
                  fontsize=8)
    zoom.set_xlabel(f"key positions {lo}-{hi - 1}, each character", fontsize=8)
    top = trace.selected[layer].shape[1]
    fig.suptitle(f"DSA top-{top} selections of MLA layer {layer} while the shipped model answers {text!r}\n"
                 f"(the README's pass-key prompt, {trace.prompt_len} prompt tokens, greedy)", fontsize=10)
    fig.legend(handles=[Patch(color=SELECTED, label="selected key"),
                        Patch(color=IN_KEY, label="selected key inside the pass key"),
                        Patch(color=SPAN, label=f"pass-key span ({PASS_KEY})")],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.supylabel("answer query (input → predicted)", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(OUT, dpi=100)
    plt.close(fig)
    return OUT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, default=3, help="MLA layer (the shipped model's: 3, 7, 8)")
    parser.add_argument("--every", type=int, default=4, help="label every n-th key position")
    args = parser.parse_args()
    print(draw(args.layer, args.every))


if __name__ == "__main__":
    main()
