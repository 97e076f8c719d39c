"""Fused projections: one product per input, the checkpoint's parameters unchanged."""

import torch
from torch import nn

import minidsa
from minidsa.model.fused import FusedLinears, RowStack


def _layers(dtype=torch.float64):
    torch.manual_seed(0)
    return [nn.Linear(60, n, bias=False, dtype=dtype) for n in (7, 33, 1)]


def test_fused_outputs_equal_the_separate_layers():
    a, b, c = _layers()
    x = torch.randn(2, 5, 60, dtype=torch.float64)
    with torch.no_grad():
        want = [a(x), torch.cat([b(x), c(x)], -1)]
        got = FusedLinears(a, (b, c))(x)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-13)  # fp64: only the summation order may differ


def test_parameters_become_views_of_one_matrix_and_follow_writes():
    a, b, c = _layers()
    fused = FusedLinears(a, b, c)
    x = torch.randn(3, 60, dtype=torch.float64)
    with torch.no_grad():
        fused(x)
        assert a.weight.data_ptr() + a.weight.numel() * 8 == b.weight.data_ptr()  # rows of one stack
        b.weight.copy_(torch.ones_like(b.weight))  # a load writes the parameter in place
        torch.testing.assert_close(fused(x)[1], x.sum(-1, keepdim=True).expand(3, 33), rtol=0, atol=1e-12)
        c.weight = nn.Parameter(torch.full((1, 60), 2.0, dtype=torch.float64))  # new storage: noticed
        torch.testing.assert_close(fused(x)[2], 2 * x.sum(-1, keepdim=True), rtol=0, atol=1e-12)


def test_mixed_dtypes_give_one_product_per_dtype():
    a, b, c = _layers(torch.float32)
    b.to(torch.float64)  # a bf16 model keeps its router in fp32: its own product, on x cast to fp32
    x = torch.randn(4, 60)
    with torch.no_grad():
        ya, yb, yc = FusedLinears(a, b, c)(x)
    assert (ya.dtype, yb.dtype, yc.dtype) == (torch.float32, torch.float64, torch.float32)
    torch.testing.assert_close(yb, b(x.double()), rtol=0, atol=1e-13)


def test_gradients_reach_every_parameter():
    a, b, c = _layers()
    x = torch.randn(3, 60, dtype=torch.float64)
    sum(y.sum() for y in FusedLinears(a, (b, c))(x)).backward()
    for layer in (a, b, c):
        torch.testing.assert_close(layer.weight.grad, x.sum(0).expand_as(layer.weight), rtol=0, atol=1e-12)
    convs = [nn.Conv1d(4, 4, 3, groups=4, bias=False, dtype=torch.float64) for _ in range(2)]
    RowStack(*convs).tensor().sum().backward()
    assert all(torch.equal(m.weight.grad, torch.ones_like(m.weight)) for m in convs)


def test_a_fused_model_saves_and_loads_its_own_names(tmp_path):
    model = minidsa.MiniDSA("tiny").eval()
    ids = torch.randint(0, 256, (1, 9))
    with torch.inference_mode():
        want = model(ids)  # the first forward fuses
    names = set(model.checkpoint_tensors())
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in names
    loaded = minidsa.load(model.save_pretrained(tmp_path / "ckpt"))
    assert set(loaded.checkpoint_tensors()) == names
    with torch.inference_mode():
        assert torch.equal(loaded(ids), want)


def test_a_wide_cpu_stack_is_a_k_major_copy_that_follows_writes():
    torch.manual_seed(1)
    a, b = nn.Linear(16, 40, bias=False, dtype=torch.float64), nn.Linear(16, 24, bias=False, dtype=torch.float64)
    fused = FusedLinears(a, b)  # 64 outputs from 16 inputs: stored [16, 64] contiguous on the CPU
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.no_grad():
        fused(x)
        stack = fused._stacks()[0][0].tensor()
        assert stack.shape == (64, 16) and stack.t().is_contiguous()
        assert a.weight.is_contiguous() and b.weight.is_contiguous()  # the parameters keep their storage
        a.weight.mul_(2)  # an optimiser step writes in place: the copy must not go stale
        torch.testing.assert_close(fused(x)[0], x @ a.weight.t(), rtol=0, atol=1e-12)


def _addresses(model):
    return {name: p.data_ptr() for name, p in model.named_parameters()}


def test_no_forward_moves_a_parameter_of_a_fresh_model():
    """A CUDA graph records weight addresses: a stack built by the first prefill, after the decode graphs were
    captured, freed the storage every replay read (NaN logits from a fresh server). Every path of a freshly
    built and a freshly loaded model must therefore leave each parameter where construction put it."""
    for model in (minidsa.MiniDSA("tiny"), minidsa.load("default", progress=False)):
        before = _addresses(model)
        cache = model.new_cache()
        sid = cache.add_sequence()
        with torch.inference_mode():
            model(torch.tensor([[256, 104]]), cache=cache, seq_ids=[sid])  # cached prefill
            model(torch.tensor([[105]]), cache=cache, seq_ids=[sid])  # cached decode
            model(torch.tensor([[256, 104, 105]]))  # no cache: the reference path
            model(torch.tensor([[7]]))  # one token without a cache
        moved = sorted(n for n, ptr in _addresses(model).items() if ptr != before[n])
        assert not moved, f"{len(moved)} parameters moved in a forward, e.g. {moved[:3]}"


def test_stacking_as_on_a_gpu_moves_nothing_after_construction(monkeypatch):
    """On a GPU every stack holds its parameters' storage (no K-major copies): a parameter in two groups (the MoE
    layer's input product and its shared expert's own) moved back and forth, and captured graphs chased it."""
    from minidsa.model import fused
    monkeypatch.setattr(fused, "K_MAJOR_ON_CPU", False)
    model = minidsa.MiniDSA("tiny")
    before, count = _addresses(model), fused.moves()
    fused.fuse_all(model)  # idempotent: nothing stale to build again
    cache = model.new_cache()
    sid = cache.add_sequence()
    with torch.inference_mode():
        model(torch.tensor([[256, 104, 105]]), cache=cache, seq_ids=[sid])
        model(torch.tensor([[106]]), cache=cache, seq_ids=[sid])
        model(torch.tensor([[256, 104]]))
    fused.fuse_all(model)
    assert fused.moves() == count
    assert _addresses(model) == before


def test_fuse_stacks_under_grad_mode_too():
    a, b, c = _layers()
    fused = FusedLinears(a, b, c)
    assert torch.is_grad_enabled() and a.weight.requires_grad
    fused.fuse()  # an explicit fuse must place the rows even where a forward would only torch.cat them
    assert a.weight.data_ptr() == fused.stacks()[0].data_ptr()
