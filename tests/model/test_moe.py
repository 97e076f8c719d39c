"""Latent MoE: router, SiTU-GLU, the layer against a dense reference, online vs offline experts,
one workspace for every layer, and conversion counts."""

import dataclasses

import pytest
import torch
from conftest import tiny_config

import minidsa
from minidsa.formats import mxfp4
from minidsa.model.experts import DIRECT_MAX_TOKENS
from minidsa.model.ffn import situ_glu


def with_moe(cfg, **changes):
    return cfg.replace(moe=dataclasses.replace(cfg.moe, **changes))


def test_situ_glu_backward_is_the_derivative():
    # The hand-written backward (recomputing from g, u) against finite differences, in fp64, over the
    # whole range: saturated tanh (|g| >> beta_gate, |u| >> beta_up), the sigmoid tails and zero.
    g = (torch.linspace(-30, 30, 41, dtype=torch.float64) + 0.1).requires_grad_()
    u = torch.linspace(-90, 90, 41, dtype=torch.float64).flip(0).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 4.0, 25.0), (g, u))
    with torch.no_grad():
        plain = situ_glu(g, u)
    assert torch.equal(situ_glu(g, u).detach(), plain)  # the recorded forward is the same expression


def test_situ_glu_under_autograd_keeps_only_its_inputs():
    # The training memory claim: the activation itself saves g and u for backward, nothing else.
    g = torch.randn(5, 7, requires_grad=True)
    u = torch.randn(5, 7, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = situ_glu(g, u)
    assert len(saved) == 2 and {id(t) for t in saved} == {id(g), id(u)}
    h.sum().backward()
    assert g.grad is not None and u.grad is not None


def test_situ_glu_formula_and_bound():
    g, u = torch.linspace(-300, 300, 1001, dtype=torch.float64), torch.linspace(300, -300, 1001, dtype=torch.float64)
    ref = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    torch.testing.assert_close(situ_glu(g, u), ref, atol=1e-12, rtol=0)
    assert situ_glu(g, u).abs().max() < 100


def test_router_bias_selects_but_does_not_weight():
    model = minidsa.MiniDSA(tiny_config(dtype="float64"))
    moe = model.moe_layers()[0]
    x = torch.randn(5, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.e_score_correction_bias[3] = 10.0  # forces expert 3 into every top-k
        ids, w = moe.route(x)
    s = torch.sigmoid(x @ moe.gate.weight.T)
    assert (ids == 3).any(-1).all()
    chosen = s.gather(1, ids)
    torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True), atol=1e-12, rtol=0)
    torch.testing.assert_close(w.sum(-1), torch.ones(5, dtype=torch.float64), atol=1e-12, rtol=0)
    rest = s.clone()
    rest[:, 3] = -1
    others = ids[ids != 3].view(5, -1)
    assert torch.equal(others.sort(-1).values, rest.topk(model.config.moe.top_k - 1, -1).indices.sort(-1).values)


def dense_reference(moe, x):
    """docs/design.md §6 with experts dequantised straight from MXFP4 (no FP8, no workspace)."""
    s = torch.sigmoid(x @ moe.gate.weight.T.to(x.dtype))
    ids = (s + moe.gate.e_score_correction_bias).topk(moe.top_k, -1).indices
    w = s.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * moe.routed_scaling_factor
    z = moe.routed_expert_down_proj(x)
    y_lat = torch.zeros_like(z)
    mats = {n: mxfp4.dequantize(*moe.experts.matrix(n), x.dtype) for n in ("w1", "w2", "w3")}
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = int(ids[t, j])
            h = situ_glu(mats["w1"][e] @ z[t], mats["w3"][e] @ z[t])
            y_lat[t] += w[t, j] * (mats["w2"][e] @ h)
    return moe.routed_expert_up_proj(moe.routed_expert_norm(y_lat)) + moe.shared_experts(x)


def test_moe_layer_equals_dense_reference():
    model = minidsa.MiniDSA(tiny_config(dtype="float64"))
    moe = model.moe_layers()[2]
    x = torch.randn(2, 7, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        got = moe(x)
        ref = dense_reference(moe, x.reshape(14, -1)).reshape(2, 7, -1)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)


def test_one_product_combine_equals_the_two_products(monkeypatch):
    # the GPU's combine (ops.linear_sum over both projections) against the CPU's (two products, then the sum),
    # in fp64 so that only the order of the sums differs; one row (the kernel's case) and several
    from minidsa.model.moe import LatentMoE
    model = minidsa.MiniDSA(tiny_config(dtype="float64"))
    moe = model.moe_layers()[1]
    with torch.no_grad():
        for rows in (1, 5):
            x = torch.randn(1, rows, model.config.hidden_size, dtype=torch.float64)
            want = moe(x)
            monkeypatch.setattr(LatentMoE, "_one_product", lambda self, t: True)
            got = moe(x)
            monkeypatch.undo()
            assert not torch.equal(want, torch.zeros_like(want))
            torch.testing.assert_close(got, want, atol=1e-13, rtol=0)


def test_online_and_offline_give_identical_logits():
    model = minidsa.load("tiny")
    ids = torch.randint(0, 256, (2, 21))
    with torch.no_grad():
        online = model(ids)
        model.set_expert_mode("offline")
        offline = model(ids)
        model.set_expert_mode("online")
    assert torch.equal(online, offline)
    cfg_offline = with_moe(minidsa.load_config("tiny"), offline_experts=True)
    with torch.no_grad():
        assert torch.equal(minidsa.MiniDSA(cfg_offline)(ids), online)


def test_workspace_rounds_when_routed_set_exceeds_it():
    base = minidsa.load("tiny")
    small_ws = minidsa.MiniDSA(with_moe(base.config, workspace_experts=3))
    ids = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        assert torch.equal(small_ws(ids), base(ids))
    assert small_ws.expert_stats()["workspace_bytes"] * 8 == base.expert_stats()["workspace_bytes"] * 3


def test_workspace_is_flat_in_depth():
    def model_with(n_layers):
        types = ["kda"] * (n_layers - 1) + ["mla"]
        return minidsa.MiniDSA(tiny_config(layer_types=types, attn_res_block_size=2))
    two, eight = model_with(2), model_with(8)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        two(ids)
        eight(ids)
    s2, s8 = two.expert_stats(), eight.expert_stats()
    assert s2["workspace_bytes"] == s8["workspace_bytes"] > 0
    assert s8["expert_bytes_mxfp4"] == 7 * s2["expert_bytes_mxfp4"]  # 1 vs 7 MoE layers (layer 0 is dense)
    ws = two.expert_workspace()
    assert ws.elements.dtype == torch.float8_e4m3fn


def test_only_routed_experts_are_converted():
    model = minidsa.load("tiny")
    cfg = model.config
    routed = []
    for moe in model.moe_layers():  # record each layer's routing decisions
        original = moe.choose

        def spy(s, original=original):
            ids, w = original(s)
            routed.append(torch.unique(ids).numel())
            return ids, w
        moe.choose = spy
    n_moe = cfg.num_layers - cfg.moe.first_dense_layers
    T = DIRECT_MAX_TOKENS + 1  # a prefill-sized call: its routed experts go through the workspace
    model.reset_expert_stats()
    with torch.no_grad():
        model(torch.randint(0, 256, (1, T)))
    assert 0 < model.expert_stats()["conversions"] == sum(routed) <= n_moe * cfg.moe.num_experts
    assert model.expert_stats()["conversions_last_forward"] == sum(routed)
    # decode-sized calls read their experts straight from MXFP4: nothing goes through the workspace
    for tokens in (1, 3):
        routed.clear()
        model.reset_expert_stats()
        with torch.no_grad():
            model(torch.randint(0, 256, (1, tokens)))
        assert len(routed) == n_moe and model.expert_stats()["conversions_last_forward"] == 0


def test_direct_paths_equal_the_workspace_path():
    """One token and a decode batch (MXFP4 read in place) give the rows the workspace path gives (fp64: exact
    values in both, only the matrix products' summation order may differ)."""
    model = minidsa.load("tiny").double()
    moe = model.moe_layers()[0]
    x = torch.randn(1, 1, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rest = torch.randn(1, DIRECT_MAX_TOKENS, x.shape[-1], dtype=torch.float64)
    with torch.no_grad():
        one = moe(x)
        few = moe(torch.cat([x, rest[:, :4]], dim=1))
        many = moe(torch.cat([x, rest], dim=1))  # a prefill-sized call: converted into the workspace
    torch.testing.assert_close(one[0, 0], many[0, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(few[0], many[0, :5], rtol=0, atol=1e-12)


def test_expert_storage_is_mxfp4():
    stats = minidsa.load("tiny").expert_stats()
    # 4.25 bits per weight (4-bit codes + one 8-bit scale per 32) vs 16 for bf16
    assert stats["expert_bytes_mxfp4"] * 16 == pytest.approx(stats["expert_bytes_bf16"] * 4.25)


def test_backward_through_online_experts():
    """The reference forward with online experts can be differentiated: while autograd records, each
    layer's dequantised experts are its own tensor, not the reused inference buffer (which the next
    layer would overwrite under the saved values)."""
    model = minidsa.MiniDSA(tiny_config())
    emb = model.language_model.model.embed_tokens.weight
    loss = model(torch.tensor([[256, 104, 105, 106]])).logsumexp(-1).sum()
    loss.backward()
    assert emb.grad is not None and torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0


def test_a_single_routed_expert_keeps_its_affinity_as_released():
    model = minidsa.MiniDSA(with_moe(tiny_config(dtype="float64"), top_k=1, routed_scaling_factor=2.5))
    moe = model.moe_layers()[0]
    x = torch.randn(5, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        ids, w = moe.route(x)
    s = torch.sigmoid(x @ moe.gate.weight.T)
    # released: renormalise only when top_k > 1; one expert's weight is its sigmoid score (< 1) times the scale
    torch.testing.assert_close(w, s.gather(1, ids) * 2.5, atol=1e-12, rtol=0)
    assert (w < 2.5).all()
