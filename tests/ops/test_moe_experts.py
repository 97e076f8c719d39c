"""Reference ops of the routed experts (minidsa/ops/moe_experts/reference.py) against what LatentMoE computes today
on the tiny model: the workspace conversion byte for byte, and the routed output y_lat of a layer."""

import pytest
import torch
from conftest import tiny_config

import minidsa
from minidsa.formats import mxfp4
from minidsa.model.experts import ExpertWorkspace
from minidsa.ops.activation.reference import situ_glu_values
from minidsa.ops.moe_experts import cpu
from minidsa.ops.moe_experts import reference as ref


@pytest.fixture(scope="module")
def model():
    return minidsa.load("tiny")


def routed_inputs(moe, x):
    """The layer's own intermediates for x [N, d]: z, the conversion plan and the routing matrix [m, N]."""
    acc = minidsa.ops.acc_dtype(x)
    logits, z, _, _ = moe.input_proj(x)  # the layer's one product for the router and the down projection
    ids, weights = moe.choose(logits.to(acc))
    z = z.to(acc)
    experts, _, _ = moe.experts.plan(ids, weights)
    routing = ((ids.unsqueeze(0) == experts.view(-1, 1, 1)) * weights).sum(-1)
    return z, experts, routing


def layer_y_lat(moe, x):
    """y_lat exactly as LatentMoE.forward produced it: the input of routed_expert_norm."""
    seen = []
    hook = moe.routed_expert_norm.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
    try:
        moe(x)
    finally:
        hook.remove()
    return seen[0]


def test_conversion_is_the_workspace_load_bit_for_bit(model):
    moe = model.moe_layers()[1]
    ws = ExpertWorkspace(model.config, "cpu")
    experts = torch.tensor([5, 0, 7, 2])
    ws.load(moe.experts, experts)
    elements = torch.full_like(ws.elements.view(torch.uint8), 0xAB).view(torch.float8_e4m3fn)
    scales = torch.full_like(ws.scales, 0xCD)
    ref.mxfp4_to_fp8_ref(moe.experts.packed, moe.experts.scales, experts, elements, scales)
    assert torch.equal(elements[:4].view(torch.uint8), ws.elements[:4].view(torch.uint8))
    assert torch.equal(scales[:4], ws.scales[:4])
    assert (elements[4:].view(torch.uint8) == 0xAB).all() and (scales[4:] == 0xCD).all()  # later slots untouched


def test_conversion_known_answer_low_nibble_first():
    # byte 0x81: even element code 1 (+0.5 = e4m3 0x30), odd element code 8 (-0.0 = 0x80); 0xF7: +6, -6.
    packed = torch.tensor([0x81, 0xF7] + [0] * 14, dtype=torch.uint8).view(1, 1, 16)
    scales = torch.tensor([[[130]]], dtype=torch.uint8)
    out, out_s = torch.zeros(2, 1, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, 1, dtype=torch.uint8)
    ref.mxfp4_to_fp8_ref(packed, scales, torch.tensor([0]), out, out_s)
    assert out[0, 0, :4].view(torch.uint8).tolist() == [0x30, 0x80, 0x4C, 0xCC] and out_s[0, 0, 0] == 130


def test_conversion_into_a_strided_workspace_matches_whole_tensor_conversion():
    # The fast path gathers four elements per uint16 of codes straight into a contiguous workspace;
    # a strided workspace view takes the copy path. Both must equal mxfp4.to_fp8 (a separate table).
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (5, 3, 48), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (5, 3, 3), dtype=torch.uint8, generator=g)
    experts = torch.tensor([4, 0, 2])
    want, want_s = mxfp4.to_fp8(packed[experts], scales[experts])
    contiguous = torch.zeros(3, 3, 96, dtype=torch.float8_e4m3fn), torch.zeros(3, 3, 3, dtype=torch.uint8)
    strided = torch.zeros(6, 3, 96, dtype=torch.float8_e4m3fn)[::2], torch.zeros(6, 3, 3, dtype=torch.uint8)[::2]
    for out, out_s in (contiguous, strided):
        ref.mxfp4_to_fp8_ref(packed, scales, experts, out, out_s)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)) and torch.equal(out_s, want_s)


@pytest.mark.parametrize("layer,tokens", [(0, 1), (3, 7), (5, 40)])
def test_reference_ops_reproduce_the_layer(model, layer, tokens):
    moe = model.moe_layers()[layer]
    x = torch.randn(tokens, model.config.hidden_size)
    with torch.no_grad():
        want = layer_y_lat(moe, x)
        z, experts, routing = routed_inputs(moe, x)
        cap = model.config.moe.workspace_experts
        n = moe.experts.packed.shape[-1]
        elements = torch.empty(cap, 3, 2 * n, dtype=torch.float8_e4m3fn)
        scales = torch.empty(cap, 3, n // 16, dtype=torch.uint8)
        ref.mxfp4_to_fp8_ref(moe.experts.packed, moe.experts.scales, experts, elements, scales)
        got_fp8 = ref.expert_mlp_fp8_ref(z, elements, scales, routing, moe.experts.beta_gate, moe.experts.beta_up)
        got_mx = ref.expert_mlp_mxfp4_ref(z, moe.experts.packed, moe.experts.scales, experts, routing,
                                          moe.experts.beta_gate, moe.experts.beta_up)
    assert got_fp8.dtype == torch.float32 and got_fp8.shape == want.shape
    # The same operations on the same values in the same order: equal to the bit.
    assert torch.equal(got_fp8, want)
    assert torch.equal(got_mx, got_fp8)  # identical weight values through one shared core


def test_fp64_inputs_stay_fp64_and_match_the_dequantised_experts():
    model64 = minidsa.MiniDSA(tiny_config(dtype="float64"))
    moe = model64.moe_layers()[0]
    x = torch.randn(3, model64.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        z, experts, routing = routed_inputs(moe, x)
        got = ref.expert_mlp_mxfp4_ref(z, moe.experts.packed, moe.experts.scales, experts, routing, 4.0, 25.0)
        want = layer_y_lat(moe, x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # and against the MXFP4 dequantisation of mxfp4.py, token by token
    w = {k: mxfp4.dequantize(*moe.experts.matrix(k), torch.float64) for k in ("w1", "w3", "w2")}
    for t in range(3):
        y = sum(routing[j, t] * w["w2"][e] @ situ_glu_values(w["w1"][e] @ z[t], w["w3"][e] @ z[t], 4.0, 25.0)
                for j, e in enumerate(experts.tolist()))
        torch.testing.assert_close(got[t], y, atol=1e-12, rtol=1e-12)


def test_bad_inputs_raise_naming_the_tensor():
    E, I, L = 3, 64, 32
    packed = torch.zeros(E, 3, I * L // 2, dtype=torch.uint8)
    scales = torch.zeros(E, 3, I * L // 32, dtype=torch.uint8)
    els = torch.zeros(2, 3, I * L, dtype=torch.float8_e4m3fn)
    z, routing, experts = torch.zeros(4, L), torch.zeros(2, 4), torch.tensor([0, 2])
    bad = [
        (ref.expert_mlp_fp8_ref, (z[:, :20], els, scales[:2], routing, 4.0, 25.0), ValueError, "z"),
        (ref.expert_mlp_fp8_ref, (z, els.float(), scales[:2], routing, 4.0, 25.0), TypeError, "elements"),
        (ref.expert_mlp_fp8_ref, (z, els, scales, routing, 4.0, 25.0), ValueError, "scales"),
        (ref.expert_mlp_fp8_ref, (z, els, scales[:2], routing[:, :3], 4.0, 25.0), ValueError, "routing"),
        (ref.expert_mlp_fp8_ref, (z, els, scales[:2], torch.zeros(3, 4), 4.0, 25.0), ValueError, "slots"),
        (ref.expert_mlp_mxfp4_ref, (z, packed, scales, experts.float(), routing, 4.0, 25.0), TypeError, "experts"),
        (ref.expert_mlp_mxfp4_ref, (z, packed, scales, torch.tensor([0, 3]), routing, 4.0, 25.0), ValueError,
         "experts"),
        (ref.expert_mlp_mxfp4_ref, (z, packed.int(), scales, experts, routing, 4.0, 25.0), TypeError, "packed"),
        (ref.mxfp4_to_fp8_ref, (packed, scales, torch.tensor([0, 1, 2]), els, scales[:2]), ValueError, "fit"),
        (ref.mxfp4_to_fp8_ref, (packed, scales, experts, els.view(torch.uint8), scales[:2]), TypeError,
         "out_elements"),
    ]
    for fn, args, err, word in bad:
        with pytest.raises(err, match=word):
            fn(*args)


def test_routed_rows_equal_the_dense_form():
    """At prefill on the host the MLP runs each slot on its routed tokens only; it must equal the dense sum
    over every slot (fp64, so only the order of the additions may differ: 1e-12 is far above it)."""
    gen = torch.Generator().manual_seed(3)
    m, N, L, I = 6, cpu.ROUTED_ROWS_MIN_TOKENS + 17, 20, 12
    z = torch.randn(N, L, generator=gen, dtype=torch.float64)
    values = torch.randn(m, 3, I * L, generator=gen, dtype=torch.float64) / 4
    routing = torch.rand(m, N, generator=gen, dtype=torch.float64)
    routing[torch.rand(m, N, generator=gen) < 0.8] = 0  # most slots get no token of a row, as top-k routing gives
    routing[2] = 0  # a slot no token is routed to
    w13 = values[:, :2].reshape(m, 2 * I, L)
    w2 = values[:, 2].unflatten(-1, (L, I))
    gu = z @ w13.mT
    dense = ((situ_glu_values(gu[..., :I], gu[..., I:], 3.0, 5.0) * routing.unsqueeze(-1)) @ w2.mT).sum(0)
    got = ref.expert_mlp(z, values, routing, 3.0, 5.0)
    torch.testing.assert_close(got, dense, rtol=0, atol=1e-12)
    torch.testing.assert_close(cpu._routed_rows(z, w13, w2, routing, 3.0, 5.0), dense, rtol=0, atol=1e-12)
