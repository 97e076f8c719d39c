"""minidsa.viz KDA and MoE pictures: the data helpers against independent computations (the KDA recurrence run
here on what the layer fed its op, the model's own conversion counter, the cache layout), and each picture
rendered to PNG with the marks, ticks, legend and title it must show."""

import inspect

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from figures import legend_texts, render  # noqa: E402

import minidsa  # noqa: E402
from minidsa.model.experts import DIRECT_MAX_TOKENS  # noqa: E402
from minidsa.viz import kda as vkda  # noqa: E402
from minidsa.viz import moe as vmoe  # noqa: E402
from minidsa.viz.tokens import find_span, token_labels  # noqa: E402

TEXT = "the pass key of kqz is 40271.\nQ: pass key?"


@pytest.fixture(scope="module")
def model():
    return minidsa.load("default")


@pytest.fixture(scope="module")
def ids(model):
    return model.tokenizer.encode(TEXT)




def test_contract_signatures():
    for fn, params in ((vkda.kda_gates, ["model", "token_ids", "layer"]),
                       (vkda.plot_kda_gates, ["model", "token_ids", "layer", "fig"]),
                       (vkda.plot_state_memory, ["config", "contexts", "ax"]),
                       (vmoe.expert_load, ["model", "token_ids"]), (vmoe.plot_expert_load, ["model", "token_ids", "ax"]),
                       (vmoe.plot_routed_experts, ["model", "token_ids", "positions", "ax"]),
                       (vmoe.plot_workspace, ["model", "ax"])):
        sig = inspect.signature(fn).parameters
        assert all(p in sig for p in params), (fn.__name__, list(sig))
    assert inspect.signature(vkda.plot_state_memory).parameters["config"].default == "k3.1-pro"


# ------------------------------------------------------------------------------------------------ KDA
def recorded_kda_calls(model, ids, monkeypatch) -> list[tuple]:
    """What each KDA layer handed its chunked op in a no-cache forward (q, k, v, g, beta, final state)."""
    calls, real = [], minidsa.ops.kda_chunk

    def spy(q, k, v, g, beta, scale, state, chunk_size):
        o, final = real(q, k, v, g, beta, scale, state, chunk_size)
        calls.append((q, k, v, g, beta, final))
        return o, final

    monkeypatch.setattr(minidsa.ops, "kda_chunk", spy)
    with torch.no_grad():
        model(torch.tensor([ids]))
    assert len(calls) == len(model.config.kda_layers)
    return calls


@pytest.mark.parametrize("layer", [None, 2])
def test_kda_gates_match_the_recurrence_run_here(model, ids, monkeypatch, layer):
    data = vkda.kda_gates(model, ids, layer)
    q, k, v, g, beta, final = recorded_kda_calls(model, ids, monkeypatch)[model.config.kda_layers.index(layer or 0)]
    T, H = len(ids), model.config.kda.num_heads
    assert data["layer"] == (layer or 0)
    assert data["decay"].shape == data["beta"].shape == data["state_norm"].shape == (T, H)
    assert (data["decay"] > 0).all() and (data["decay"] <= 1).all()
    assert (data["decay"] >= np.exp(model.config.kda.decay_lower_bound) - 1e-6).all()
    assert ((data["beta"] > 0) & (data["beta"] < 1)).all()
    np.testing.assert_allclose(data["decay"], g[0].exp().mean(-1).numpy(), rtol=1e-5)
    np.testing.assert_allclose(data["beta"], beta[0].numpy(), rtol=1e-5)
    for t in (0, 5, T // 2, T - 1):  # the state after token t: the recurrence over the prefix 0..t
        _, state = minidsa.ops.kda_recurrent(q[:, :t + 1], k[:, :t + 1], v[:, :t + 1], g[:, :t + 1], beta[:, :t + 1])
        np.testing.assert_allclose(data["state_norm"][t], state[0].flatten(1).norm(dim=1).numpy(), rtol=1e-4)
    np.testing.assert_allclose(data["state_norm"][-1], final[0].flatten(1).norm(dim=1).numpy(), rtol=1e-4)


def test_kda_gates_name_a_wrong_layer(model, ids):
    with pytest.raises(ValueError, match="not a KDA layer"):
        vkda.kda_gates(model, ids, model.config.mla_layers[0])


def test_plot_kda_gates_shows_heads_over_token_labels(model, ids):
    fig = vkda.plot_kda_gates(model, ids)
    axes = fig.axes
    assert len(axes) == 3
    H = model.config.kda.num_heads
    for ax, word in zip(axes, ("decay", "beta", "norm")):
        assert word in ax.get_title()
        assert legend_texts(ax) == [f"head {h}" for h in range(H)]
        assert len(ax.get_lines()) == H
    np.testing.assert_allclose(axes[1].get_lines()[0].get_ydata(), vkda.kda_gates(model, ids)["beta"][:, 0])
    labels = token_labels(ids)
    ticks = axes[2].get_xticks()
    assert [t.get_text() for t in axes[2].get_xticklabels()] == [labels[int(p)] for p in ticks]
    assert "layer 0" in fig._suptitle.get_text()
    render(fig)


def test_state_memory_follows_the_cache_layout():
    cfg = minidsa.load_config("k3.1-pro")
    ctx = (1_000, 1_000_000)
    data = vkda.state_memory("k3.1-pro", ctx)
    n_mla, n_kda, kc = len(cfg.mla_layers), len(cfg.kda_layers), cfg.kda
    kv = n_mla * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 2  # bf16 per token
    index = n_mla * (cfg.indexer.head_dim * 1 + 4)  # fp8 key + its fp32 scale
    state = n_kda * (kc.num_heads * kc.head_dim ** 2 + (kc.conv_size - 1) * 3 * kc.num_heads * kc.head_dim) * 4
    np.testing.assert_array_equal(data["kv_cache"], np.array(ctx) * kv)
    np.testing.assert_array_equal(data["indexer_keys"], np.array(ctx) * index)
    np.testing.assert_array_equal(data["kda_state"], [state, state])
    layout = minidsa.viz._common.meta_model("k3.1-pro").cache_layout()
    assert kv + index == layout.bytes_per_token() and state == layout.state_bytes_per_sequence()


def test_plot_state_memory_is_log_log_with_three_curves():
    fig = vkda.plot_state_memory("k3.1-pro")
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    texts = legend_texts(ax)
    assert len(texts) == 4 and any("KDA state" in t for t in texts) and any("KV cache =" in t for t in texts)
    kda_line = next(line for line in ax.get_lines() if "KDA state" in line.get_label())
    assert len(set(kda_line.get_ydata())) == 1  # constant in the context
    assert "k3.1-pro" in ax.get_title()
    render(fig)


# ------------------------------------------------------------------------------------------------ MoE
def test_expert_load_counts_every_routed_token(model, ids):
    load = vmoe.expert_load(model, ids)
    m = model.config.moe
    assert load.shape == (len(model.moe_layers()), m.num_experts)
    assert (load.sum(1) == len(ids) * m.top_k).all()
    # the model's own counter: routed experts converted into the workspace in that forward (a prefill-sized
    # one: decode-sized calls read MXFP4 in place and convert nothing)
    assert len(ids) > DIRECT_MAX_TOKENS
    assert int((load > 0).sum()) == model.expert_stats()["conversions_last_forward"]
    vmoe.expert_load(model, ids[:DIRECT_MAX_TOKENS])
    assert model.expert_stats()["conversions_last_forward"] == 0


def test_expert_routing_is_the_routers_choice(model, ids):
    routing = vmoe.expert_routing(model, ids)
    for eids, w in routing:
        assert eids.shape == w.shape == (len(ids), model.config.moe.top_k)
        assert all(len(set(row)) == len(row) for row in eids.tolist())  # top-k distinct experts per token
        np.testing.assert_allclose(w.sum(1), model.config.moe.routed_scaling_factor, rtol=1e-5)


def test_plot_expert_load_is_the_count_matrix(model, ids):
    fig = vmoe.plot_expert_load(model, ids)
    ax = fig.axes[0]
    np.testing.assert_array_equal(ax.get_images()[0].get_array(), vmoe.expert_load(model, ids))
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"layer {i}" for i in vmoe.moe_layer_indices(model)]
    assert list(ax.get_xticks()) == list(range(model.config.moe.num_experts))
    assert "top-2" in ax.get_title() and len(fig.axes) == 2  # the heat map and its colour bar
    render(fig)


def test_plot_routed_experts_marks_each_tokens_experts(model, ids):
    fig = vmoe.plot_routed_experts(model, ids, "40271")
    ax = fig.axes[0]
    pos = list(find_span(ids, "40271"))
    assert legend_texts(ax) == [f"token {p} '{token_labels(ids)[p]}'" for p in pos]
    routing = vmoe.expert_routing(model, ids)
    points = ax.collections
    assert len(points) == len(pos) * len(routing)
    for j, p in enumerate(pos):
        for layer, (eids, _) in enumerate(routing):
            assert sorted(points[j * len(routing) + layer].get_offsets()[:, 1]) == sorted(eids[p])
    assert "Top-2" in ax.get_title()
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"layer {i}" for i in vmoe.moe_layer_indices(model)]
    render(fig)
    with pytest.raises(ValueError, match="positions"):
        vmoe.plot_routed_experts(model, ids, [len(ids)])


def test_plot_workspace_bars_are_the_expert_stats(model, ids):
    fig = vmoe.plot_workspace(model, token_ids=ids * 2)  # prefill-sized: decode-sized calls convert nothing
    stats = model.expert_stats()
    ax = fig.axes[0]
    widths = [p.get_width() for p in ax.patches]
    assert len(widths) == 5
    m = model.config.moe
    per_expert = 3 * m.latent_size * m.expert_intermediate_size * (1 + 1 / 32)
    assert widths[:3] == [stats["expert_bytes_mxfp4"], stats["expert_bytes_bf16"] / 2 * (1 + 1 / 32),
                          stats["expert_bytes_bf16"]]
    assert widths[3] == stats["workspace_bytes"] == m.workspace_experts * per_expert
    assert 0 < widths[4] <= widths[3]
    assert legend_texts(ax) == ["stored experts (whole model)", "run-time FP8 workspace"]
    assert "workspace" in ax.get_title()
    render(fig)
