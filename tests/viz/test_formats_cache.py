"""minidsa.viz MXFP4 and paged-cache pictures: the round-trip error against the format's own quantise /
dequantise (0 for exactly representable values), the expert bytes against the config's sizes, and each
picture rendered to PNG with the marks, ticks, legend and title it must show."""


import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from figures import legend_texts, render  # noqa: E402

import minidsa  # noqa: E402
from minidsa.formats import mxfp4  # noqa: E402
from minidsa.viz import cache as vcache  # noqa: E402
from minidsa.viz import mxfp4 as vmx  # noqa: E402


def representable(blocks: int, generator: torch.Generator) -> torch.Tensor:
    """[blocks, 32]: E2M1 values times a power of two per block, each block holding a +-6 (so its scale is exact)."""
    table = mxfp4.e2m1_table(torch.float32)
    codes = torch.randint(0, 16, (blocks, 32), generator=generator)
    codes[:, 0] = torch.randint(0, 2, (blocks,), generator=generator) * 8 + 7  # +6 or -6
    scale = torch.exp2(torch.randint(-10, 10, (blocks, 1), generator=generator).float())
    return table[codes] * scale


# ---------------------------------------------------------------------------------------------- MXFP4
def test_exactly_representable_values_have_zero_error():
    w = representable(64, torch.Generator().manual_seed(0))
    err = vmx.relative_error(w)
    assert err.size == int((w != 0).sum()) and (err == 0).all()
    fig = vmx.plot_quantisation_error(w, bins=20)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert len(heights) == 20 and heights[0] == err.size and sum(heights[1:]) == 0
    assert legend_texts(ax)[0] == f"elements ({err.size} of {err.size} exact)"
    render(fig)


def test_relative_error_is_the_formats_round_trip():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    back = mxfp4.dequantize(*mxfp4.quantize(w))
    expected = ((back.double() - w.double()).abs() / w.double().abs()).reshape(-1).numpy()
    np.testing.assert_allclose(vmx.relative_error(w), expected, rtol=1e-12)
    assert vmx.relative_error(w).max() <= 1.0 and np.median(vmx.relative_error(w)) < 0.2
    odd = torch.randn(5, 7, generator=torch.Generator().manual_seed(2))  # 35 elements: flattened, zero-padded blocks
    orig, rt = vmx.round_trip(odd)
    assert rt.shape == odd.shape
    torch.testing.assert_close(rt.reshape(-1), mxfp4.dequantize(*mxfp4.quantize(
        torch.cat([odd.reshape(-1), torch.zeros(29)])))[:35])


def test_plot_quantisation_error_marks_median_and_worst():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    fig = vmx.plot_quantisation_error(w)
    ax = fig.axes[0]
    texts = legend_texts(ax)
    assert len(texts) == 3 and texts[1].startswith("median") and texts[2].startswith("worst")
    assert ax.get_yscale() == "log" and "8x64" in ax.get_title()
    render(fig)
    with pytest.raises(ValueError, match="nonzero"):
        vmx.plot_quantisation_error(torch.zeros(32))


def test_plot_mxfp4_values_shows_the_16_codes_at_each_scale():
    fig = vmx.plot_mxfp4_values(scales=(-1, 0, 2))
    ax = fig.axes[0]
    table = mxfp4.e2m1_table(torch.float32).numpy()
    assert len(ax.collections) == 3
    for row, (points, s) in enumerate(zip(ax.collections, (-1, 0, 2))):
        np.testing.assert_array_equal(points.get_offsets()[:, 0], table * 2.0 ** s)
        assert (points.get_offsets()[:, 1] == row).all()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["2^-1", "2^0", "2^2"]
    texts = legend_texts(ax)
    assert len(texts) == 3 and "E8M0 code 129" in texts[2] and "±24" in texts[2]
    codes = {t.get_text() for t in ax.texts}
    assert {"0111", "1111", "0001"} <= codes and "E2M1" in ax.get_title()
    render(fig)


def test_expert_format_bytes_are_half_a_byte_per_element_plus_scales():
    cfg = minidsa.load_config("k3.1-pro")
    m = cfg.moe
    n_moe = cfg.num_layers - m.first_dense_layers
    elements = n_moe * m.num_experts * 3 * m.latent_size * m.expert_intermediate_size
    b = vmx.expert_format_bytes("k3.1-pro")
    assert b["elements"] == elements
    assert b["mxfp4"] == 0.5 * elements + elements / 32
    assert b["fp8"] == elements + elements / 32 and b["bf16"] == 2 * elements


def test_plot_format_bytes_stacks_elements_and_scales():
    fig = vmx.plot_format_bytes("k3.1-pro")
    ax = fig.axes[0]
    b = vmx.expert_format_bytes("k3.1-pro")
    assert len(ax.patches) == 6  # 3 element bars + 3 scale bars
    tops = [p.get_y() + p.get_height() for p in ax.patches[3:]]
    assert tops == [b["mxfp4"], b["fp8"], b["bf16"]]
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == ["MXFP4", "FP8 e4m3", "bf16"]
    assert all(t.get_text().endswith(" GB") for t in ax.texts) and len(ax.texts) == 3
    assert len(legend_texts(ax)) == 2 and "k3.1-pro" in ax.get_title()
    render(fig)


# ---------------------------------------------------------------------------------------------- cache
@pytest.fixture
def fragmented_cache():
    """Three sequences; the first freed after use, so the third reuses its blocks out of order."""
    model = minidsa.MiniDSA(minidsa.load_config("tiny"))
    cache = model.new_cache(num_blocks=16)
    a, b, c = cache.add_sequence(), cache.add_sequence(), cache.add_sequence()
    cache.reserve({a: 20, b: 9})
    cache.commit(a, 20)
    cache.commit(b, 9)
    cache.free(a)
    cache.reserve({c: 30, b: 17})
    cache.commit(c, 30)
    cache.commit(b, 17)
    return cache


def test_plot_block_tables_draws_every_table_entry(fragmented_cache):
    cache = fragmented_cache
    fig = vcache.plot_block_tables(cache)
    ax = fig.axes[0]
    sids = cache.sequences()
    arrows = [t for t in ax.texts if getattr(t, "arrow_patch", None) is not None]
    assert len(arrows) == sum(len(cache.block_table(s)) for s in sids)
    # each arrow runs from logical block j of a table to the physical block the table maps it to
    assert sorted((round(a.xy[0]), round(a.xyann[0])) for a in arrows) == \
        sorted((b, j) for s in sids for j, b in enumerate(cache.block_table(s)))
    texts = legend_texts(ax)
    assert texts == [f"seq {s}: {cache.seq_len(s)} tokens, {len(cache.block_table(s))} blocks" for s in sids] + ["free block"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["physical blocks"] + [f"seq {s} table" for s in sids]
    assert list(ax.get_xticks()) == list(range(cache.layout.num_blocks))
    cells = {t.get_text() for t in ax.texts if getattr(t, "arrow_patch", None) is None}
    assert {"8/8", "1/8", "6/8", "0/8"} <= cells  # valid tokens per physical block
    assert f"{cache.num_free_blocks} free" in ax.get_title()
    # the colour of physical block b is its owner's legend colour
    legend = ax.get_legend()
    colour = {s: tuple(h.get_facecolor()) for s, h in zip(sids, legend.legend_handles)}
    rects = ax.patches[: cache.layout.num_blocks]
    for b, rect in enumerate(rects):
        owner = cache.block_owner[b]
        if owner >= 0:
            assert tuple(rect.get_facecolor()) == colour[owner]
    render(fig)


def test_plot_block_tables_limits_a_large_pool():
    cache = minidsa.MiniDSA(minidsa.load_config("tiny")).new_cache(num_blocks=200)
    sid = cache.add_sequence()
    cache.reserve({sid: 20})
    fig = vcache.plot_block_tables(cache)
    ax = fig.axes[0]
    assert len(ax.get_xticks()) == 3 + 4 and "blocks 0-6 shown" in ax.get_title()
    render(fig)
