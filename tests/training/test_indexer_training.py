"""The indexer's KL training signal (docs/design.md §2)."""

import pytest
import torch
from conftest import tiny_config

import minidsa
from minidsa import ops
from minidsa.training.indexer_losses import _capture_mla_inputs, focus_loss, indexer_kl_loss, layer_kl


def indexer_params(model):
    return {n for n, _ in model.named_parameters() if ".indexer." in n}


def projections_and_selection(mla, x):
    """(projections, decompressed keys [B, S, H, dn + dr], indexer scores [B, T, S], top-k [B, T, k]) of a
    layer input x [B, T, d], without gradients: what the loop-by-loop checks below start from."""
    B, T, _ = x.shape
    with torch.no_grad():
        p = mla._project(x)
        k, _ = mla.decompress(p["kv_latent"], p["k_pe"])
        ix = mla.indexer
        q_idx, w_idx = ix.queries(mla.q_a_layernorm(mla.q_a_proj(x)), x)
        scores = ops.index_scores(q_idx, ix.keys(x)["index_key"], w_idx, ix.softmax_scale)
        return p, k, scores, ops.topk_indices(scores, ix.topk, torch.arange(T).expand(B, T))


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_only_the_indexer_learns(stage):
    model = minidsa.load("tiny")
    ids = torch.randint(0, 256, (2, 24))
    loss = indexer_kl_loss(model, ids, stage)
    assert loss.item() >= 0 and torch.isfinite(loss)
    loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and with_grad <= indexer_params(model)
    assert any(n.endswith("indexer.wq_b.weight") for n in with_grad)


def test_warmup_training_lowers_the_kl():
    model = minidsa.load("tiny")
    with torch.no_grad():  # sharpen the main attention so there is a pattern to learn (a fresh model's is ~uniform)
        for i in model.config.mla_layers:
            model.language_model.model.layers[i].self_attn.q_b_proj.weight.mul_(40)
    ids = torch.randint(0, 256, (2, 32))
    params = [p for n, p in model.named_parameters() if ".indexer." in n]
    opt = torch.optim.Adam(params, lr=3e-2)
    first = indexer_kl_loss(model, ids, "warmup").item()
    for _ in range(30):
        opt.zero_grad()
        indexer_kl_loss(model, ids, "warmup").backward()
        opt.step()
    assert indexer_kl_loss(model, ids, "warmup").item() < 0.5 * first  # observed ~0.15x


def test_bad_stage():
    with pytest.raises(ValueError, match="stage"):
        indexer_kl_loss(minidsa.load("tiny"), torch.randint(0, 256, (1, 4)), "pretrain")


def test_sparse_target_is_the_attention_over_the_selected_keys():
    """Megatron's compute_dsa_indexer_loss: per query, each head's softmax over the selected keys only, summed
    over heads and L1-normalised, against softmax(I) over the same keys. Written here row by row, head by head."""
    model = minidsa.MiniDSA(tiny_config(dtype="float64"))
    with torch.no_grad():  # sharpen the heads differently so the two possible targets are far apart
        for i in model.config.mla_layers:
            w = model.language_model.model.layers[i].self_attn.q_b_proj.weight
            w.mul_(torch.linspace(5, 60, w.shape[0], dtype=w.dtype).unsqueeze(1))
    ids = torch.randint(0, 256, (2, 20))
    mla, x = next(iter(_capture_mla_inputs(model, ids, dense=False).items()))
    B, T, _ = x.shape
    p, k, scores, sel = projections_and_selection(mla, x)
    kl, old_kl = 0.0, 0.0
    for b in range(B):
        for t in range(T):
            keys = [int(s) for s in sel[b, t] if s >= 0]
            logits = torch.einsum("hd,shd->hs", p["q"][b, t], k[b, keys]) * mla.softmax_scale  # [H, |keys|]
            target = torch.softmax(logits, -1).sum(0)
            target = target / target.sum()
            causal = torch.einsum("hd,shd->hs", p["q"][b, t], k[b, : t + 1]) * mla.softmax_scale
            old = torch.softmax(causal, -1).sum(0)[keys]  # the dense distribution cut down: not the target
            old = old / old.sum()
            log_q = torch.log_softmax(scores[b, t, keys], -1)
            kl += float((target * (target.log() - log_q)).sum())
            old_kl += float((old * (old.log() - log_q)).sum())
    kl, old_kl = kl / (B * T), old_kl / (B * T)
    got = layer_kl(mla, x, "sparse").item()
    assert abs(got - kl) < 1e-10 * max(1.0, kl)  # fp64 throughout: the two differ only by summation order
    assert abs(kl - old_kl) > 1e-6  # the old target (dense, then cut down) is 1e4 tolerances away: the test can fail


def test_indexer_key_norm_uses_rms_norm_eps():
    cfg = tiny_config(rms_norm_eps=1e-2)  # large enough to move the keys visibly
    model = minidsa.MiniDSA(cfg)
    ix = model.language_model.model.layers[cfg.mla_layers[0]].self_attn.indexer
    assert ix.k_norm.eps == 1e-2
    x = torch.randn(1, 5, cfg.hidden_size) * 0.01  # small keys: variance comparable to eps
    with torch.no_grad():
        k = ix.wk(x)
        got = ix.keys(x)["index_key"]
        for eps, same in ((1e-2, True), (1e-6, False)):
            want = torch.nn.functional.layer_norm(k, (k.shape[-1],), ix.k_norm.weight, ix.k_norm.bias, eps)
            assert torch.allclose(got, want, atol=1e-6) == same  # 1e-6: fp32 rounding of a unit-scale LayerNorm


def test_focus_loss_is_minus_log_of_the_selected_mass():
    """Per head and query: -log(dense softmax mass on the indexer's top-k), averaged over heads and the queries
    with more causal keys than top-k; written here row by row, head by head, in fp64."""
    model = minidsa.MiniDSA(tiny_config(dtype="float64"))
    with torch.no_grad():  # sharpen the heads so the selected mass is far from uniform's k / (t + 1)
        for i in model.config.mla_layers:
            model.language_model.model.layers[i].self_attn.q_b_proj.weight.mul_(30)
    ids = torch.randint(0, 256, (2, 20))
    mla, x = next(iter(_capture_mla_inputs(model, ids, dense=False).items()))
    B, T, _ = x.shape
    p, k, _, sel = projections_and_selection(mla, x)
    terms = []
    for b in range(B):
        for t in range(mla.indexer.topk, T):
            keys = [int(s) for s in sel[b, t] if s >= 0]
            probs = torch.softmax(torch.einsum("hd,shd->hs", p["q"][b, t], k[b, : t + 1]) * mla.softmax_scale, -1)
            terms += (-probs[:, keys].sum(-1).log()).tolist()  # one per head
    want = sum(terms) / len(terms)
    got = focus_loss(mla, x)
    assert abs(got.item() - want) < 1e-10 * max(1.0, want)  # fp64: the two differ only by summation order
    assert want > 0.05  # far from 0, so a loss that ignored the selection could not pass


def test_focus_loss_trains_the_main_attention_not_the_indexer():
    model = minidsa.load("tiny")
    ids = torch.randint(0, 256, (2, 24))
    inputs = _capture_mla_inputs(model, ids, dense=False)
    mla, x = next(iter(inputs.items()))
    x = x.detach().requires_grad_(True)
    focus_loss(mla, x).backward()
    with_grad = {n for n, p in mla.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert not {n for n in with_grad if n.startswith("indexer.")}
    assert {"q_b_proj.weight", "kv_b_proj.weight"} <= with_grad and x.grad.abs().sum() > 0
    short = torch.randn(1, mla.indexer.topk, x.shape[-1])  # no query has more than top-k keys: nothing outside
    assert focus_loss(mla, short).item() == 0.0
