"""Pictures of DeepSeek Sparse Attention at work: which keys the lightning indexer handed each query of an MLA
layer, how it scored them, and how much of the dense attention those keys hold (docs/design.md §2).

Each MLA query attends to its indexer's top-k keys only, so a retrieval task works only when the indexer
picks the right tokens. ``plot_selection`` draws the picks of a ``GenerationTrace``: query rows (the answer
rows, by default every row) against key columns labelled with their tokens, a highlighted span such as the
pass key, image tokens, KV block boundaries and the prompt/generation boundary. ``plot_index_scores`` draws
the continuous scores the top-k was taken from, picks overlaid; ``plot_recall`` the share of the dense
attention mass that the picks capture. The data helpers (``selection_matrix``, ``indexer_scores``,
``selection_recall``, ``pick_share``, ``random_pick_share``) return numpy arrays and floats for assertions.

Query rows: ``queries=None`` is every row of the trace; ``"answer"`` the rows whose query produced a generated
token (the prompt's last position, then each generated token but the last); or any range/list of positions.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from .. import ops
from ..model.mla import GatedMLA
from ..model.trace import GenerationTrace
from ..training.forward import indexer_scores as _projected_scores
from ..training.indexer_losses import attention_target
from .tokens import find_span, token_labels

SELECTED, IN_SPAN, SPAN = (0.12, 0.22, 0.55), (0.85, 0.2, 0.1), (1.0, 0.93, 0.6)
IMAGE_SELECTED, IMAGE_TOKEN, FUTURE = (0.95, 0.55, 0.1), (0.99, 0.87, 0.74), (0.9, 0.9, 0.9)
MAX_TICK_LABELS = 48  # key labels drawn when label_every is None; more crowd each other out
MAX_ROW_LABELS = 40  # query rows labelled "token → next token" up to this many, else by position


# ------------------------------------------------------------------------------------------ data helpers
def selection_matrix(trace: GenerationTrace, layer: int) -> np.ndarray:
    """[queries, keys] array: 1 where the query at row t selected key s in MLA layer ``layer``, else 0."""
    _check_layer(trace, layer)
    sel = trace.selected[layer].long()
    n = len(trace.token_ids)
    m = torch.zeros(sel.shape[0], n + 1)
    m.scatter_(1, torch.where(sel >= 0, sel, torch.full_like(sel, n)), 1.0)  # -1 lands in the dropped column
    return m[:, :n].numpy()


def indexer_scores(model, trace: GenerationTrace, layer: int) -> np.ndarray:
    """[T, T] float64 (T = len(trace.token_ids)): the lightning-indexer scores I[t, s] of MLA layer ``layer``,
    -inf above the diagonal (keys a query cannot see), from one no-cache forward of ``trace.token_ids``.
    Text only: ValueError for a trace with images (the scores would need the images' embeddings)."""
    mla, x = _layer_input(model, trace, layer)
    with torch.no_grad():
        scores = _projected_scores(mla, mla._project(x))[0].double().cpu()
    T = scores.shape[0]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).numpy()


def selection_recall(model, trace: GenerationTrace, layer: int) -> np.ndarray:
    """[T] float64: per query row, the share of the dense attention mass of MLA layer ``layer`` (each head's
    softmax over every causal key, summed over heads and normalised) on the keys the trace says it selected;
    exactly 1.0 for rows with no more causal keys than top-k (they keep every key). Text only, as
    ``indexer_scores``."""
    mla, x = _layer_input(model, trace, layer)
    T = x.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    dense = attention_target(mla, x, causal[None])[0].double().cpu()  # [T, S]
    keep = ops.indices_to_mask(trace.selected[layer][None].to(torch.int32), T)[0]
    recall = (dense * keep).sum(-1).clamp(0.0, 1.0)
    topk = trace.selected[layer].shape[1]
    recall[torch.arange(T) + 1 <= topk] = 1.0
    return recall.numpy()


def pick_share(trace: GenerationTrace, layer: int, positions, queries="answer") -> float:
    """Share of the picks (valid top-k entries) of the ``queries`` rows of MLA layer ``layer`` that land on
    ``positions`` (positions, or a text located with find_span)."""
    _check_layer(trace, layer)
    sel = trace.selected[layer][_rows(trace, queries)].long()
    target = torch.tensor(sorted(_positions(trace, positions)), dtype=torch.long)
    valid = sel >= 0
    hits = torch.isin(sel, target) & valid
    return float(hits.sum()) / max(int(valid.sum()), 1)


def random_pick_share(trace: GenerationTrace, layer: int, positions, queries="answer") -> float:
    """The expected ``pick_share`` if each query row instead drew as many picks as it has, uniformly without
    replacement from its causal keys 0..t: sum_t k_t * |positions <= t| / (t + 1) over sum_t k_t."""
    _check_layer(trace, layer)
    rows = _rows(trace, queries)
    k = (trace.selected[layer][rows] >= 0).sum(-1).double()
    target = torch.tensor(sorted(_positions(trace, positions)), dtype=torch.long)
    t = torch.tensor(rows, dtype=torch.long)
    inside = (target[None, :] <= t[:, None]).sum(-1).double()
    return float((k * inside / (t + 1)).sum()) / max(float(k.sum()), 1.0)


# ------------------------------------------------------------------------------------------ pictures
def plot_selection(trace: GenerationTrace, layer: int, *, queries=None, highlight=None, label_every=None,
                   block_size=None, keys=None, ax=None):
    """The keys (columns, token labels) each query row (rows) selected in MLA layer ``layer``.

    ``highlight``: positions or a text (find_span) shaded as a span; picks inside it in red. Image tokens
    shaded orange; keys a row cannot see (after it) grey; KV block boundaries (``block_size``, default the
    trace's when it records one) dotted; the prompt/generation boundary dashed. ``keys``: the key positions
    to show (a range; default 0 up to the last row). Returns the Figure.
    """
    m = selection_matrix(trace, layer)
    rows = _rows(trace, queries)
    lo, hi = _key_range(rows, keys, m.shape[1])
    span = _positions(trace, highlight)
    picked = m[rows][:, lo:hi] > 0
    key_pos = np.arange(lo, hi)
    in_span = np.isin(key_pos, sorted(span))
    is_image = np.isin(key_pos, trace.image_positions)
    rgba = np.zeros(picked.shape + (4,))
    future = key_pos[None, :] > np.asarray(rows)[:, None]
    rgba[future] = FUTURE + (1.0,)
    for mask, colour in ((picked, SELECTED), (picked & is_image, IMAGE_SELECTED), (picked & in_span, IN_SPAN)):
        rgba[mask] = colour + (1.0,)
    fig, ax, own = _fig_ax(ax, (9, 1.6 + 0.22 * min(len(rows), 30)))
    ax.imshow(rgba, interpolation="nearest", aspect="auto", extent=(lo - 0.5, hi - 0.5, len(rows) - 0.5, -0.5),
              zorder=2)
    labels = token_labels(trace)
    name = _span_name(highlight, span)
    _shade(ax, span, lo, hi, SPAN, f"highlight: {name}")
    _shade(ax, trace.image_positions, lo, hi, IMAGE_TOKEN, "image token")
    _key_axis(ax, labels, lo, hi, label_every, span)
    _query_axis(ax, labels, rows)
    block_size = getattr(trace, "block_size", None) if block_size is None else block_size
    marks = _boundaries(ax, trace, rows, lo, hi, block_size)
    handles = [Patch(color=SELECTED, label="selected key")]
    if span:
        handles += [Patch(color=IN_SPAN, label=f"selected key inside {name}"), Patch(color=SPAN, label=f"highlight: {name}")]
    if is_image.any():
        handles += [Patch(color=IMAGE_SELECTED, label="selected image key"), Patch(color=IMAGE_TOKEN, label="image token")]
    if future.any():
        handles.append(Patch(color=FUTURE, label="future key (not visible)"))
    _legend(ax, handles + marks)
    ax.set_title(f"DSA top-{trace.selected[layer].shape[1]} selection of MLA layer {layer}"
                 f" ({_rows_name(queries, rows)})", fontsize=10, pad=12)
    return _finish(fig, own)


def plot_index_scores(model, trace: GenerationTrace, layer: int, *, queries=None, highlight=None, label_every=None,
                      keys=None, ax=None):
    """The lightning-indexer scores I[t, s] of MLA layer ``layer`` as a heat map (query rows x key columns with
    token labels, the axes of plot_selection), the top-k picks of the trace as markers, ``highlight`` outlined."""
    scores = indexer_scores(model, trace, layer)
    rows = _rows(trace, queries)
    lo, hi = _key_range(rows, keys, scores.shape[1])
    shown = np.ma.masked_invalid(scores[rows][:, lo:hi])
    fig, ax, own = _fig_ax(ax, (9, 1.8 + 0.22 * min(len(rows), 30)))
    cmap = plt.get_cmap("viridis").with_extremes(bad=FUTURE)
    im = ax.imshow(shown, cmap=cmap, interpolation="nearest", aspect="auto",
                   extent=(lo - 0.5, hi - 0.5, len(rows) - 0.5, -0.5))
    fig.colorbar(im, ax=ax, label="index score I[t, s]", pad=0.01, shrink=0.5, anchor=(0.0, 1.0))
    picked = selection_matrix(trace, layer)[rows][:, lo:hi] > 0
    r, c = np.nonzero(picked)
    ax.scatter(c + lo, r, s=20, marker="s", facecolors="none", edgecolors="red", linewidths=1.0, zorder=3)
    handles = [Line2D([], [], ls="", marker="s", mfc="none", mec="red", label=f"top-{trace.selected[layer].shape[1]} pick")]
    span = _positions(trace, highlight)
    labels = token_labels(trace)
    if span:
        name = _span_name(highlight, span)
        for a, b in _runs(span, lo, hi):
            ax.add_patch(Rectangle((a - 0.5, -0.5), b - a, len(rows), fill=False, ec="orange", lw=1.5, zorder=4,
                                   label=f"highlight: {name}"))
        handles.append(Patch(fill=False, ec="orange", lw=1.5, label=f"highlight: {name}"))
    if np.ma.getmaskarray(shown).any():
        handles.append(Patch(color=FUTURE, label="future key (not visible)"))
    _key_axis(ax, labels, lo, hi, label_every, span)
    _query_axis(ax, labels, rows)
    _legend(ax, handles, below_colorbar=True)
    ax.set_title(f"Lightning-indexer scores of MLA layer {layer} ({_rows_name(queries, rows)})", fontsize=10, pad=12)
    return _finish(fig, own)


def plot_recall(model, trace: GenerationTrace, layer: int, *, queries=None, ax=None):
    """One bar per query row: the share of MLA layer ``layer``'s dense attention mass on its selected keys
    (``selection_recall``); rows that keep every key (no more causal keys than top-k) in grey."""
    recall = selection_recall(model, trace, layer)
    rows = _rows(trace, queries)
    topk = trace.selected[layer].shape[1]
    values = recall[rows]
    sparse = np.asarray(rows) + 1 > topk
    fig, ax, own = _fig_ax(ax, (max(4.0, min(12.0, 0.12 * len(rows) + 3)), 3.2))
    x = np.arange(len(rows))
    handles = [ax.bar(x[sparse], values[sparse], width=0.8, color=SELECTED, label=f"recall (more than {topk} causal keys)")]
    if (~sparse).any():
        handles.append(ax.bar(x[~sparse], values[~sparse], width=0.8, color="0.7", label=f"<= {topk} causal keys: all kept"))
    if sparse.any():
        mean = float(values[sparse].mean())
        handles.append(ax.axhline(mean, color=IN_SPAN, ls="--", lw=1, label=f"mean of the sparse rows: {mean:.2f}"))
    ax.set_ylim(0, 1.05)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylabel("dense attention mass\non the selected keys")
    labels = token_labels(trace)
    if len(rows) <= MAX_ROW_LABELS:
        ax.set_xticks(x, [_row_label(labels, t) for t in rows], rotation=90, fontsize=7, family="monospace")
    else:
        step = -(-len(rows) // MAX_ROW_LABELS)
        ax.set_xticks(x[::step], [str(t) for t in rows[::step]], rotation=90, fontsize=7)
    ax.set_xlabel("query (token → next token)" if len(rows) <= MAX_ROW_LABELS else "query position")
    _legend(ax, handles)
    ax.set_title(f"Indexer recall of MLA layer {layer}, top-{topk} ({_rows_name(queries, rows)})", fontsize=10)
    return _finish(fig, own)


# ------------------------------------------------------------------------------------------ shared pieces
def _check_layer(trace: GenerationTrace, layer: int) -> None:
    if layer not in trace.selected:
        raise ValueError(f"layer {layer} is not an MLA layer of this trace; MLA layers: {sorted(trace.selected)}")


def _layer_input(model, trace: GenerationTrace, layer: int) -> tuple[GatedMLA, torch.Tensor]:
    """(the GatedMLA of decoder layer ``layer``, its normalised input x [1, T, d]) from one no-cache forward."""
    _check_layer(trace, layer)
    if trace.image_positions:
        raise ValueError("this trace has images: the indexer scores need the images' embeddings; "
                         "indexer_scores and selection_recall support text-only traces")
    mlas = [m for m in model.modules() if isinstance(m, GatedMLA) and m.layer_idx == layer]
    if not mlas:
        raise ValueError(f"the model has no MLA layer {layer}; the trace's MLA layers: {sorted(trace.selected)}")
    seen = {}
    hook = mlas[0].register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0]))
    try:
        with torch.no_grad():
            model(torch.tensor([trace.token_ids], dtype=torch.long, device=model.device))
    finally:
        hook.remove()
    return mlas[0], seen["x"]


def _rows(trace: GenerationTrace, queries) -> list[int]:
    """Query positions: None = every row, "answer" = the rows that produced generated tokens, else the given."""
    n = len(trace.token_ids)
    if queries is None:
        return list(range(n))
    if isinstance(queries, str):
        if queries != "answer":
            raise ValueError(f"queries = {queries!r}; use None, 'answer' or positions")
        if n <= trace.prompt_len:
            raise ValueError("queries='answer' but the trace has no generated tokens")
        return list(range(trace.prompt_len - 1, n - 1))
    rows = [int(t) for t in queries]
    bad = [t for t in rows if not 0 <= t < n]
    if not rows or bad:
        raise ValueError(f"queries must be positions in [0, {n}); got {rows if not rows else bad}")
    return rows


def _positions(trace: GenerationTrace, positions) -> set[int]:
    """A set of key positions: None = none, a str = the positions spelling it (find_span), else the given."""
    if positions is None:
        return set()
    if isinstance(positions, str):
        return set(find_span(trace, positions))
    return {int(p) for p in positions}


def _key_range(rows: list[int], keys, n: int) -> tuple[int, int]:
    """[lo, hi) of the key columns: ``keys`` (a range or list of positions) or 0 .. the last row."""
    if keys is None:
        return 0, max(rows) + 1
    keys = list(keys)
    lo, hi = min(keys), max(keys) + 1
    if lo < 0 or hi > n:
        raise ValueError(f"keys must lie in [0, {n}); got {lo}..{hi - 1}")
    return lo, hi


def _runs(positions, lo: int, hi: int) -> list[tuple[int, int]]:
    """Contiguous runs [a, b) of the positions inside [lo, hi)."""
    runs: list[list[int]] = []
    for p in sorted(p for p in positions if lo <= p < hi):
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return [(a, b) for a, b in runs]


def _shade(ax, positions, lo: int, hi: int, colour, label: str) -> None:
    """A full-height background patch (under the picks) over each run of ``positions``."""
    for a, b in _runs(positions, lo, hi):
        ax.add_patch(Rectangle((a - 0.5, 0), b - a, 1, transform=ax.get_xaxis_transform(), color=colour, lw=0,
                               zorder=1, label=label))


def _span_name(highlight, span: set[int]) -> str:
    if isinstance(highlight, str):
        return repr(highlight)
    return f"positions {min(span)}-{max(span)}" if span else ""


def _rows_name(queries, rows: list[int]) -> str:
    if isinstance(queries, str):
        return f"answer queries {rows[0]}-{rows[-1]}"
    if rows == list(range(rows[0], rows[-1] + 1)):
        return f"queries {rows[0]}-{rows[-1]}"
    return f"{len(rows)} queries"


def _row_label(labels: list[str], t: int) -> str:
    """Query row t as "input → predicted" (the token at t and the one after it, when there is one)."""
    return f"{labels[t]} → {labels[t + 1]}" if t + 1 < len(labels) else labels[t]


def _key_axis(ax, labels: list[str], lo: int, hi: int, every, span: set[int]) -> None:
    """Token labels on every ``every``-th key column (auto: at most MAX_TICK_LABELS), the span's in red."""
    every = every or max(1, -(-(hi - lo) // MAX_TICK_LABELS))
    ticks = list(range(lo, hi, every))
    ax.set_xticks(ticks, [labels[t] for t in ticks], fontsize=9 if every == 1 else 7, family="monospace")
    for t, text in zip(ticks, ax.get_xticklabels()):
        if t in span:
            text.set_color(IN_SPAN)
            text.set_fontweight("bold")
        if every == 1 and len(labels[t]) > 1:  # "bos", "img", "\x0a": upright they would overlap their neighbours
            text.set_rotation(90)
            text.set_fontsize(7)
    if every == 1:
        ax.set_xticks(np.arange(lo, hi + 1) - 0.5, minor=True)
        ax.grid(which="minor", axis="x", color="0.85", lw=0.5)
        ax.tick_params(which="minor", length=0)
    what = "each key" if every == 1 else f"every {every}th key labelled"
    ax.set_xlabel(f"key position {lo}-{hi - 1} ({what})", fontsize=8)
    ax.set_xlim(lo - 0.5, hi - 0.5)


def _query_axis(ax, labels: list[str], rows: list[int]) -> None:
    """Rows as "token → next token" when few, else by position (integer ticks)."""
    idx = np.arange(len(rows))
    if len(rows) <= MAX_ROW_LABELS:
        ax.set_yticks(idx, [_row_label(labels, t) for t in rows], fontsize=8, family="monospace")
        ax.set_ylabel("query (input → predicted)", fontsize=8)
    else:
        step = -(-len(rows) // MAX_ROW_LABELS)
        ax.set_yticks(idx[::step], [f"{rows[i]} {labels[rows[i]]}" for i in idx[::step]], fontsize=6,
                      family="monospace")
        ax.set_ylabel("query position", fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)


def _boundaries(ax, trace: GenerationTrace, rows: list[int], lo: int, hi: int, block_size) -> list[Line2D]:
    """Prompt/generation boundary (dashed, labelled) and KV block boundaries (dotted); their legend handles."""
    handles = []
    g = trace.prompt_len
    if lo < g < hi:
        ax.axvline(g - 0.5, color="0.3", ls="--", lw=0.9, zorder=3)
        ax.text(g - 0.5, 1.0, "prompt ", transform=ax.get_xaxis_transform(), fontsize=7, va="bottom", ha="right",
                color="0.3")
        if hi - g >= 0.1 * (hi - lo):  # room for the right-hand label
            ax.text(g - 0.5, 1.0, " generated", transform=ax.get_xaxis_transform(), fontsize=7, va="bottom",
                    color="0.3")
    # a row is labelled "input -> predicted": from row prompt_len - 1 on, the predictions are the generated tokens
    first_gen = next((i for i, t in enumerate(rows) if t >= g - 1), None)
    if first_gen:  # rows on both sides
        ax.axhline(first_gen - 0.5, color="0.3", ls="--", lw=0.9, zorder=3)
    if lo < g < hi or first_gen:
        handles.append(Line2D([], [], color="0.3", ls="--", lw=0.9, label="prompt | generation"))
    if block_size:
        edges = [b for b in range((lo // block_size + 1) * block_size, hi, block_size)]
        for b in edges:
            ax.axvline(b - 0.5, color="0.4", ls=":", lw=0.8, zorder=1.5)
        if edges:
            handles.append(Line2D([], [], color="0.4", ls=":", lw=0.8, label=f"KV block ({block_size} tokens)"))
    return handles


def _fig_ax(ax, figsize):
    """(figure, axes, whether the figure is ours): a new one-axes figure unless ``ax`` is given."""
    if ax is not None:
        return ax.figure, ax, False
    fig = plt.figure(figsize=figsize)
    return fig, fig.add_subplot(), True


def _legend(ax, handles, below_colorbar: bool = False) -> None:
    """The legend outside the axes, on the right (at the bottom, under a colour bar anchored at the top)."""
    ax.legend(handles=handles, loc="lower left" if below_colorbar else "upper left",
              bbox_to_anchor=(1.01, 0.0 if below_colorbar else 1.0), fontsize=7, frameon=False, borderaxespad=0)


def _finish(fig, own: bool):
    if own:
        fig.tight_layout()
    return fig
