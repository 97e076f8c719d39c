"""minidsa.viz Block AttnRes pictures: the depth-weight matrix is the trace's mean weights, and the picture shows
one row per mixer against integer, named source columns, with a colour bar, a legend and a title."""

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import minidsa  # noqa: E402
from minidsa import viz  # noqa: E402


@pytest.fixture(scope="module")
def trace():
    trace = minidsa.generate("the pass key of kqz is 40271.\nQ: pass key?\nA: ", temperature=0, max_new_tokens=4,
                             trace=True).trace
    return trace


def test_depth_weight_matrix_is_the_mean_over_tokens(trace):
    names, m = viz.depth_weight_matrix(trace)
    assert names == list(trace.depth_weights) and "out" in names
    for i, name in enumerate(names):
        w = trace.depth_weights[name].double().numpy()
        n = w.shape[1]
        np.testing.assert_allclose(m[i, :n], w.mean(0), rtol=1e-6)
        assert np.isnan(m[i, n:]).all()
        assert np.nansum(m[i]) == pytest.approx(1.0, abs=1e-5)  # softmax weights over the sources
    with pytest.raises(ValueError, match="no AttnRes depth weights"):
        viz.depth_weight_matrix(minidsa.GenerationTrace([256], 1))


def test_plot_depth_weights(trace):
    names, m = viz.depth_weight_matrix(trace)
    width = m.shape[1]
    fig = viz.plot_depth_weights(trace)
    ax = fig.axes[0]
    assert len(fig.axes) == 2  # the matrix and its colour bar
    ticks = ax.get_xticks()
    assert list(ticks) == list(range(width)) and all(float(t).is_integer() for t in ticks)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["emb"] + [f"b{j}" for j in range(1, width - 1)] + ["partial"]
    assert viz.source_names(width) == [t.get_text() for t in ax.get_xticklabels()]
    assert [t.get_text() for t in ax.get_yticklabels()] == names
    assert "depth weights" in ax.get_title() and f"{len(trace.token_ids)} tokens" in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["no such source\nat this depth"]
    shown = np.ma.filled(ax.images[0].get_array(), np.nan)
    for i, name in enumerate(names):  # each mixer's partial sum in the last column, its blocks from column 0
        n = trace.depth_weights[name].shape[1]
        np.testing.assert_allclose(shown[i, -1], m[i, n - 1])
        np.testing.assert_allclose(shown[i, : n - 1], m[i, : n - 1])
        assert np.isnan(shown[i, n - 1: width - 1]).all()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=50)
    plt.close(fig)
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_plot_depth_weights_some_mixers_into_an_axes(trace):
    fig, ax = plt.subplots()
    assert viz.plot_depth_weights(trace, mixers=["out", "3.attn"], ax=ax) is fig
    assert [t.get_text() for t in ax.get_yticklabels()] == ["out", "3.attn"]
    assert list(ax.get_yticks()) == [0, 1]
    with pytest.raises(ValueError, match="unknown mixers.*'9.zzz'"):
        viz.plot_depth_weights(trace, mixers=["9.zzz"])
    plt.close(fig)
