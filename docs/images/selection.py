"""Draw docs/images/selection.png: the keys that the shipped model's DSA indexer selected while it answered
the README's pass-key prompt.

    python docs/images/selection.py            # writes docs/images/selection.png next to this file

One MLA layer (layer 3 by default), one row per answer query: the query at the prompt's last position,
which predicts the first digit, then each generated digit fed back, which predicts the next token. Both
panels are ``minidsa.viz.plot_selection``: every key on top, the keys around the pass key below.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import minidsa  # noqa: E402
from minidsa.viz import find_span, plot_selection  # noqa: E402

PROMPT = ("the river runs past old town where people walk slowly The pass key of kqz is 40271. "
          "birds sing of morning light on hills far away and the sky is blue\nQ: pass key of kqz?\nA: ")
PASS_KEY = "40271"
OUT = Path(__file__).resolve().with_name("selection.png")


def draw(layer: int, every: int) -> Path:
    torch.set_num_threads(1)
    model = minidsa.load("default", progress=False)
    text = minidsa.generate(PROMPT, model, temperature=0, max_new_tokens=8, trace=True,
                            progress=False)
    trace = text.trace
    key = find_span(trace, PASS_KEY)
    rows = range(trace.prompt_len - 1, len(trace.token_ids) - 1)  # the "answer" rows
    lo, hi = max(0, key.start - 14), min(rows[-1] + 1, key.stop + 14)

    fig, (ax, zoom) = plt.subplots(2, 1, figsize=(9, 5), dpi=100)
    plot_selection(trace, layer, queries="answer", highlight=PASS_KEY, label_every=every, ax=ax)
    plot_selection(trace, layer, queries="answer", highlight=PASS_KEY, label_every=1, keys=range(lo, hi), ax=zoom)
    ax.add_patch(Rectangle((lo - 0.5, -0.5), hi - lo, len(rows), fill=False, ec="0.3", lw=1, ls=":", zorder=4))
    ax.set_xlabel(f"every key position, 0 = bos (every {every}th character shown; dotted: the zoom below)",
                  fontsize=8)
    zoom.set_xlabel(f"key positions {lo}-{hi - 1}, each character", fontsize=8)
    handles = ax.get_legend().legend_handles  # the full panel has every kind of mark
    for a in (ax, zoom):  # one title, one legend and one y label for the two panels
        a.get_legend().remove()
        a.set_title("")
        a.set_ylabel("")
    top = trace.selected[layer].shape[1]
    fig.suptitle(f"DSA top-{top} selections of MLA layer {layer} while the shipped model answers {text!r}\n"
                 f"(the README's pass-key prompt, {trace.prompt_len} prompt tokens, greedy)", fontsize=10)
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
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
