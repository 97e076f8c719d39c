"""minidsa.viz token helpers and DSA selection pictures: each picture renders and shows what it must (token tick
labels, the highlighted span, the legend, the layer), and each data helper agrees with an independent
computation (the indexer formula, the trace's top-k, a hand count, a Monte-Carlo estimate)."""

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import minidsa  # noqa: E402
from minidsa import viz  # noqa: E402
from minidsa.model.mla import GatedMLA  # noqa: E402
from minidsa.viz.selection import selection_matrix  # noqa: E402

PROMPT = ("the river runs past old town where people walk slowly The pass key of kqz is 40271. "
          "birds sing of morning light on hills far away and the sky is blue\nQ: pass key of kqz?\nA: ")
KEY = "40271"


@pytest.fixture(scope="module")
def model():
    return minidsa.load("default", progress=False)


@pytest.fixture(scope="module")
def trace(model):
    text = minidsa.generate(PROMPT, model, temperature=0, max_new_tokens=8, trace=True)
    trace = text.trace
    assert text == KEY  # the README's answer: the pictures below are of a model that retrieves
    return trace


def render(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=50)
    plt.close(fig)
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
    return buf.getvalue()


def legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def span_patches(ax, label: str) -> list[Rectangle]:
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_label() == label]


def answer_rows(trace) -> list[int]:
    return list(range(trace.prompt_len - 1, len(trace.token_ids) - 1))


# ------------------------------------------------------------------------------------------ tokens
def test_token_labels_and_find_span():
    tok = minidsa.ByteTokenizer()
    ids = [tok.bos_id, ord("a"), ord(" "), ord("\n"), 0x09, 0xC3, tok.eos_id, tok.media_pad_id, tok.pad_id]
    assert viz.token_labels(ids) == ["bos", "a", "␣", "⏎", "\\x09", "\\xc3", "eos", "img", "pad"]
    ids = tok.encode("abc 40271 and 40271")
    span = viz.find_span(ids, KEY)
    assert span == range(5, 10) and tok.decode([ids[i] for i in span]) == KEY  # the first occurrence; bos = 0
    assert viz.find_span(torch.tensor(ids), "c 4") == range(3, 6)
    with pytest.raises(ValueError, match="'99999'"):
        viz.find_span(ids, "99999")


def test_find_span_of_a_trace(trace):
    span = viz.find_span(trace, KEY)
    assert span == range(1 + PROMPT.index(KEY), 1 + PROMPT.index(KEY) + len(KEY))
    assert "".join(viz.token_labels(trace)[i] for i in span) == KEY


# ------------------------------------------------------------------------------------------ data helpers
def test_selection_matrix_marks_exactly_the_selected_keys():
    trace = minidsa.generate("abcdefghijklmnop", max_new_tokens=3, temperature=0, trace=True,
                             stop_at_eos=False).trace
    layer = min(trace.selected)
    m = selection_matrix(trace, layer)
    sel = trace.selected[layer]
    assert m.shape == (len(trace.token_ids), len(trace.token_ids))
    for t in range(m.shape[0]):
        assert set(m[t].nonzero()[0].tolist()) == {int(s) for s in sel[t] if s >= 0}
    with pytest.raises(ValueError, match="not an MLA layer"):
        selection_matrix(trace, 0)


def mla_input(model, trace, layer):
    """The layer's GatedMLA and its input, captured here independently of the viz helpers."""
    mla = next(m for m in model.modules() if isinstance(m, GatedMLA) and m.layer_idx == layer)
    seen = []
    hook = mla.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    with torch.no_grad():
        model(torch.tensor([trace.token_ids]))
    hook.remove()
    return mla, seen[0]


def test_indexer_scores_are_the_indexer_formula_and_give_the_traced_picks(model, trace):
    layer = 3
    scores = viz.indexer_scores(model, trace, layer)
    T = len(trace.token_ids)
    assert scores.shape == (T, T)
    assert np.isneginf(scores[np.triu_indices(T, 1)]).all() and np.isfinite(scores[np.tril_indices(T)]).all()
    mla, x = mla_input(model, trace, layer)
    with torch.no_grad():
        c_q = mla.q_a_layernorm(mla.q_a_proj(x))
        q, w = mla.indexer.queries(c_q, x)
        k = mla.indexer.dequant_keys(mla.indexer.keys(x))
        # I[t, s] = sum_h w[t, h] ReLU(D^-0.5 q[t, h] . k[s]), by hand and through the op
        by_hand = torch.einsum("th,ths->ts", w[0].double(),
                               torch.relu(torch.einsum("thd,sd->ths", q[0].double(), k[0].double()) * mla.indexer.softmax_scale))
        op = minidsa.ops.index_scores(q, k, w, mla.indexer.softmax_scale, backend="torch")[0].double()
    low = np.tril_indices(T)
    np.testing.assert_allclose(scores[low], by_hand.numpy()[low], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scores[low], op.numpy()[low], rtol=1e-6, atol=1e-6)
    topk = trace.selected[layer].shape[1]
    for t in range(T):  # each row's top-k of the scores is what the cached generation selected, up to ties
        sel = [int(s) for s in trace.selected[layer][t] if s >= 0]
        row = scores[t, : t + 1]
        assert len(sel) == min(topk, t + 1)
        kth = np.sort(row)[::-1][len(sel) - 1]
        assert set(np.nonzero(row > kth + 1e-5)[0]) <= set(sel) and (row[sel] >= kth - 1e-5).all(), t


def test_selection_recall_is_the_dense_mass_on_the_picks(model, trace):
    layer = 3
    recall = viz.selection_recall(model, trace, layer)
    topk = trace.selected[layer].shape[1]
    T = len(trace.token_ids)
    assert recall.shape == (T,) and ((recall >= 0) & (recall <= 1)).all()
    assert (recall[:topk] == 1.0).all()  # rows 0..topk-1 have at most top-k causal keys: all are kept
    assert recall[answer_rows(trace)].mean() > 0.5  # the trained indexer holds most of the answers' attention
    mla, x = mla_input(model, trace, layer)
    with torch.no_grad():  # one row by hand: every head's softmax over causal keys, averaged over heads
        p = mla._project(x)
        k, _ = mla.decompress(p["kv_latent"], p["k_pe"])
        t = T - 2
        s = torch.einsum("hd,shd->hs", p["q"][0, t].double(), k[0, : t + 1].double()) * mla.softmax_scale
        dense = torch.softmax(s, -1).mean(0)
    picked = [int(j) for j in trace.selected[layer][t] if j >= 0]
    assert recall[t] == pytest.approx(float(dense[picked].sum()), abs=1e-5)


def test_pick_share_is_the_hand_count(trace):
    key = set(viz.find_span(trace, KEY))
    for layer in trace.selected:
        rows = [trace.selected[layer][t].tolist() for t in answer_rows(trace)]
        hits = sum(1 for row in rows for s in row if s in key)
        picks = sum(1 for row in rows for s in row if s >= 0)
        assert viz.pick_share(trace, layer, KEY, "answer") == pytest.approx(hits / picks)
        assert viz.pick_share(trace, layer, sorted(key), answer_rows(trace)) == pytest.approx(hits / picks)
    assert viz.pick_share(trace, 3, KEY) > 5 * viz.random_pick_share(trace, 3, KEY)  # layer 3 retrieves the key


def test_random_pick_share_matches_monte_carlo(trace):
    layer, rng = 3, np.random.default_rng(0)
    key = np.asarray(viz.find_span(trace, KEY))
    queries = list(range(2, len(trace.token_ids), 6))  # rows with fewer keys than top-k and rows with more
    counts = [int((trace.selected[layer][t] >= 0).sum()) for t in queries]
    trials, hits = 2000, 0
    for t, k in zip(queries, counts):  # k picks uniformly without replacement among keys 0..t
        picks = rng.random((trials, t + 1)).argsort(axis=1)[:, :k]
        hits += int(np.isin(picks, key).sum())
    estimate = hits / (trials * sum(counts))
    expected = viz.random_pick_share(trace, layer, KEY, queries)
    assert expected == pytest.approx(estimate, abs=3e-3) and 0 < expected < 0.1
    assert viz.random_pick_share(trace, layer, KEY, [3]) == 0.0  # the key lies after query 3


def test_helpers_reject_bad_arguments(model, trace):
    with pytest.raises(ValueError, match="not an MLA layer"):
        viz.pick_share(trace, 0, KEY)
    with pytest.raises(ValueError, match="queries"):
        viz.pick_share(trace, 3, KEY, [len(trace.token_ids)])
    with pytest.raises(ValueError, match="'nope'"):
        viz.plot_selection(trace, 3, highlight="nope")


# ------------------------------------------------------------------------------------------ pictures
def test_plot_selection_answer_rows(trace):
    key = viz.find_span(trace, KEY)
    fig = viz.plot_selection(trace, 3, queries="answer", highlight=KEY, label_every=1)
    ax = fig.axes[0]
    labels = viz.token_labels(trace)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["␣ → 4", "4 → 0", "0 → 2", "2 → 7", "7 → 1", "1 → eos"]
    ticks = [int(x) for x in ax.get_xticks()]
    assert ticks == list(range(len(trace.token_ids) - 1))  # every key the last answer query could see
    assert [t.get_text() for t in ax.get_xticklabels()] == labels[: len(ticks)]
    assert "".join(t.get_text() for t in ax.get_xticklabels() if t.get_color() != "black") == KEY  # span in red
    (patch,) = span_patches(ax, f"highlight: '{KEY}'")
    assert (patch.get_x(), patch.get_width()) == (key.start - 0.5, len(key))
    assert legend_texts(ax) == ["selected key", f"selected key inside '{KEY}'", f"highlight: '{KEY}'",
                                "future key (not visible)", "prompt | generation"]
    assert "MLA layer 3" in ax.get_title() and "answer" in ax.get_title()
    pixels = ax.images[0].get_array()  # the picked cells, in the picked colour: the trace's own picks
    rows = answer_rows(trace)
    red = np.all(np.isclose(pixels[..., :3], viz.selection.IN_SPAN), axis=-1)
    assert np.array_equal(np.nonzero(red), np.nonzero(selection_matrix(trace, 3)[rows][:, : len(ticks)]
                                                      * np.isin(np.arange(len(ticks)), key)))
    render(fig)


def test_plot_selection_all_rows_zoom_and_blocks(trace):
    key = viz.find_span(trace, KEY)
    fig, (top, zoom) = plt.subplots(2, 1)
    assert viz.plot_selection(trace, 7, highlight=list(key), block_size=8, ax=top) is fig
    viz.plot_selection(trace, 8, queries="answer", keys=range(40, 100), label_every=1, block_size=8, ax=zoom)
    assert [int(x) for x in zoom.get_xticks()] == list(range(40, 100))
    assert [t.get_text() for t in zoom.get_xticklabels()] == viz.token_labels(trace)[40:100]
    assert zoom.get_xlim() == (39.5, 99.5)
    dotted = sorted(line.get_xdata()[0] for line in zoom.lines if line.get_linestyle() == ":")
    assert dotted == [47.5, 55.5, 63.5, 71.5, 79.5, 87.5, 95.5]  # KV block boundaries of 8 tokens
    assert "KV block (8 tokens)" in legend_texts(zoom) and "MLA layer 8" in zoom.get_title()
    assert len(top.get_yticks()) <= 40 and all(float(y).is_integer() for y in top.get_yticks())  # many rows: by position
    (patch,) = span_patches(top, f"highlight: positions {key.start}-{key.stop - 1}")
    assert (patch.get_x(), patch.get_width()) == (key.start - 0.5, len(key))
    dashed = [line for line in top.lines if line.get_linestyle() == "--"]
    assert sorted(float(line.get_ydata()[0]) for line in dashed if line.get_ydata()[0] == line.get_ydata()[1]) == [
        trace.prompt_len - 1.5]  # rows predicting generated tokens start at the prompt's last position
    render(fig)


def test_plot_selection_marks_image_tokens():
    image = np.zeros((28, 28, 3), dtype=np.uint8)
    image[6:22, 6:22] = (200, 40, 40)
    trace = minidsa.generate(f"{minidsa.tokenizer.IMAGE_MARKER}\nQ: colour?\nA: ", images=[image], temperature=0,
                             max_new_tokens=3, trace=True).trace
    assert trace.image_positions
    fig = viz.plot_selection(trace, 3)
    ax = fig.axes[0]
    assert {"selected image key", "image token"} <= set(legend_texts(ax))
    shaded = span_patches(ax, "image token")
    covered = {p for r in shaded for p in range(int(r.get_x() + 0.5), int(r.get_x() + 0.5 + r.get_width()))}
    assert covered == set(trace.image_positions)
    render(fig)
    with pytest.raises(ValueError, match="images"):
        viz.indexer_scores(minidsa.load("default", progress=False), trace, 3)


def test_plot_index_scores(model, trace):
    key = viz.find_span(trace, KEY)
    fig = viz.plot_index_scores(model, trace, 3, queries="answer", highlight=KEY)
    ax = fig.axes[0]
    assert len(fig.axes) == 2  # the heat map and its colour bar
    assert legend_texts(ax) == ["top-8 pick", f"highlight: '{KEY}'", "future key (not visible)"]
    (outline,) = span_patches(ax, f"highlight: '{KEY}'")
    assert (outline.get_x(), outline.get_width()) == (key.start - 0.5, len(key))
    rows = answer_rows(trace)
    marks = {(int(x), int(y)) for x, y in ax.collections[0].get_offsets()}
    assert marks == {(int(s), i) for i, t in enumerate(rows) for s in trace.selected[3][t] if s >= 0}
    labels = viz.token_labels(trace)
    assert [t.get_text() for t in ax.get_xticklabels()] == [labels[int(x)] for x in ax.get_xticks()]
    assert "MLA layer 3" in ax.get_title()
    render(fig)


def test_plot_recall(model, trace):
    queries = range(2, 30)
    fig = viz.plot_recall(model, trace, 3, queries=queries)
    ax = fig.axes[0]
    heights = [b.get_height() for b in ax.patches]
    recall = viz.selection_recall(model, trace, 3)
    np.testing.assert_allclose(sorted(heights), sorted(recall[list(queries)]))
    texts = legend_texts(ax)
    assert texts[0] == "recall (more than 8 causal keys)" and texts[1] == "<= 8 causal keys: all kept"
    assert texts[2].startswith("mean of the sparse rows: ")
    labels = viz.token_labels(trace)
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"{labels[t]} → {labels[t + 1]}" for t in queries]
    assert "MLA layer 3" in ax.get_title()
    render(fig)
