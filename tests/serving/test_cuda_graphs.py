"""The padded decode step a CUDA graph captures, run eagerly on the CPU: padding rows (position -1, slot -1,
context length 0, a read-only state slot) change nothing, and the real rows equal the unpadded step.
Capture and replay themselves need a GPU (benchmarks/bench_serving.py checks graphed == eager there)."""

import pytest
import torch
from conftest import kernel_device

import minidsa
from minidsa.serving.cuda_graphs import buckets, padded_decode_context, publish_rows, run_padded


def test_buckets_cover_every_batch_size():
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(3) == [1, 2, 3]
    assert buckets(1) == [1]


def prefilled(model, lengths):
    cache = model.new_cache()
    sids = [cache.add_sequence() for _ in lengths]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for sid, n in zip(sids, lengths):
            model(torch.randint(0, 256, (1, n), generator=gen).to(model.device), cache=cache, seq_ids=[sid])
    return cache, sids


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_rows_read_and_write_nothing(tiny_model64, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    # Kernels run where kernel tests run: compiled on a GPU, else in Triton's interpreter on the CPU.
    on_gpu = backend == "triton" and kernel_device() != "cpu"
    model = minidsa.MiniDSA(tiny_model64.config, device=kernel_device()) if on_gpu else tiny_model64
    lengths = [5, 8, 21]  # shorter than top-k (8), equal to it, longer
    ids = torch.tensor([[11], [12], [13]], device=model.device)
    eager_cache, sids = prefilled(model, lengths)
    padded_cache, psids = prefilled(model, lengths)
    model.set_backend(backend)
    try:
        with torch.inference_mode():
            want = model(ids, cache=eager_cache, seq_ids=sids)
            padded_cache.reserve({s: n + 1 for s, n in zip(psids, lengths)})
            max_blocks = -(-model.config.max_seq_len // padded_cache.block_size)
            ctx = padded_decode_context(padded_cache, psids, 8, max_blocks, model.device)
            got = run_padded(model, torch.cat([ids, ids.new_zeros(5, 1)]), ctx)
            publish_rows(ctx, len(psids))
    finally:
        model.set_backend(None)
    torch.testing.assert_close(got[:3].double(), want.double(), rtol=0, atol=1e-10)  # fp64: the same sums
    assert torch.isfinite(got).all()  # a padding row attends to nothing and gives zeros, not NaN
    for layer in range(eager_cache.layout.num_layers):
        for name in eager_cache.layout.plane_names:
            torch.testing.assert_close(padded_cache.plane(layer, name), eager_cache.plane(layer, name), rtol=0,
                                       atol=1e-12)
    for a, b in zip(padded_cache.state, eager_cache.state):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12)
    assert [padded_cache.seq_len(s) for s in psids] == [n + 1 for n in lengths]


def test_cuda_graphs_on_needs_a_cuda_model(tiny_model):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="cuda_graphs='on' needs a model on a CUDA device"):
        minidsa.Engine(tiny_model, cuda_graphs="on")
    assert minidsa.Engine(tiny_model).graphs is None  # "auto" on a CPU model: eager steps


def test_compile_decode_needs_captured_graphs(tiny_model):
    with pytest.raises(ValueError, match="compile_decode=True compiles the captured decode graphs"):
        minidsa.Engine(tiny_model, compile_decode=True)
    with pytest.raises(ValueError, match="cuda_graphs='off'"):
        minidsa.Engine(tiny_model, cuda_graphs="off", compile_decode=True)
