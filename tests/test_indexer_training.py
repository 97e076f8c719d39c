"""The indexer's KL training signal (docs/design.md §2)."""

import pytest
import torch

import minidsa
from minidsa.indexer_training import indexer_kl_loss


def indexer_params(model):
    return {n for n, _ in model.named_parameters() if ".indexer." in n}


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
