"""The padded decode step a CUDA graph captures, run eagerly on the CPU: padding rows (position -1, slot -1,
context length 0, a read-only state slot) change nothing, and the real rows equal the unpadded step.
Capture and replay themselves need a GPU: the first engine of a fresh process is checked against eager
steps in a subprocess where CUDA is present."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import kernel_device

import minidsa
from minidsa import SamplingParams
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


def test_a_fresh_model_decodes_first_as_a_graph_captures_it():
    """The CPU form of the fresh-process check: a freshly built model's first forward is the all-padding decode
    step a graph capture runs; then a prefill, then the padded step of the real sequence, which must equal the
    eager decode and read the weights where the capture found them."""
    model = minidsa.MiniDSA(minidsa.load_config("tiny").replace(dtype="float64"))
    cache = model.new_cache()
    max_blocks = -(-model.config.max_seq_len // cache.block_size)
    placed = {n: p.data_ptr() for n, p in model.named_parameters()}  # no forward may move them (model/fused.py)
    with torch.inference_mode():
        run_padded(model, torch.zeros(4, 1, dtype=torch.long), padded_decode_context(cache, [], 4, max_blocks, "cpu"))
        sid, twin = cache.add_sequence(), cache.add_sequence()
        prompt = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(0))
        model(torch.cat([prompt, prompt]), cache=cache, seq_ids=[sid, twin])
        want = model(torch.tensor([[42]]), cache=cache, seq_ids=[twin])
        cache.reserve({sid: 38})
        ctx = padded_decode_context(cache, [sid], 4, max_blocks, "cpu")
        got = run_padded(model, torch.tensor([[42], [0], [0], [0]]), ctx)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == placed  # where a captured graph reads them
    torch.testing.assert_close(got[:1].double(), want.double(), rtol=0, atol=1e-12)  # fp64, the same sums


FRESH_ENGINE = textwrap.dedent("""
    import sys, torch, minidsa
    config, backend = sys.argv[1], sys.argv[2]
    model = minidsa.MiniDSA(minidsa.load_config(config).replace(dtype="float32"), device="cuda").set_backend(backend)
    addresses = {n: p.data_ptr() for n, p in model.named_parameters()}
    engine = minidsa.Engine(model, max_num_seqs=4)  # the first thing this process does on the GPU
    prompts = ["the pass key of kqz is 40271. Q: pass key of kqz?\\nA: ", "a", "hello there " * 9]
    greedy = minidsa.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    graphed = engine.generate(prompts, greedy, progress=False)
    assert engine.stats()["cuda_graph_replays"] > 0
    eager = minidsa.Engine(model, max_num_seqs=4, cuda_graphs="off").generate(prompts, greedy, progress=False)
    for g, e in zip(graphed, eager):
        assert g.finish_reason == e.finish_reason == "length", (g.finish_reason, g.error, e.finish_reason, e.error)
        assert g.token_ids == e.token_ids, (g.token_ids, e.token_ids)
    moved = [n for n, p in model.named_parameters() if p.data_ptr() != addresses[n]]
    assert not moved, moved[:3]
    print("fresh engine OK")
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("config,backend", [("tiny", "triton"), ("laptop", "triton"), ("tiny", "torch")])
def test_first_engine_of_a_fresh_process_replays_what_eager_steps_give(config, backend):
    """The engine captures its graphs before any forward has run in the process, as ``serve`` does; its greedy
    tokens must equal eager steps' (fp32: no near-tie flips a choice between the two, they run the same
    kernels). A test that warms anything first would hide exactly this path."""
    if backend == "triton":
        pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", FRESH_ENGINE, config, backend], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0 and "fresh engine OK" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_capture_again_when_a_weight_moves():
    model = minidsa.MiniDSA(minidsa.load_config("tiny").replace(dtype="float32"), device="cuda")
    greedy = minidsa.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = minidsa.Engine(model, max_num_seqs=2)
    first = engine.generate(["hello"], greedy, progress=False)[0].token_ids
    kda = next(layer.self_attn for layer in model.language_model.model.layers if hasattr(layer.self_attn, "f_b_proj"))
    kda.f_b_proj.weight.data = kda.f_b_proj.weight.data.clone()  # new storage: the graphs' address is stale
    again = engine.generate(["hello"], greedy, progress=False)[0].token_ids
    assert again == first
    assert engine.graphs.graphs  # captured again


@pytest.mark.parametrize("shaped", [False, True])
@pytest.mark.parametrize("max_num_seqs", [2, 4])
def test_the_start_up_warm_up_leaves_the_cache_and_the_outputs_as_they_were(tiny_model, max_num_seqs, shaped,
                                                                            monkeypatch):
    """A GPU engine runs ``ModelRunner.warm_up`` at start-up (the kernels of its steps compiled before the first
    request); called on a CPU engine, it must leave every block and state slot free and change no output (the
    engine without it is the reference). With two state slots it runs two prefill pieces, with more a one-token
    row beside them; the longer piece keeps a KDA state, and where the engine has step graphs (run eagerly here)
    the step is laid out to its graph's shape."""
    from minidsa.serving import runner as runner_module
    from minidsa.serving.step_graphs import StepGraphs
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = ["the pass key is 40271. the pass key is", "abc" * 30]
    want = [o.token_ids for o in minidsa.Engine(tiny_model, max_num_seqs=max_num_seqs).generate(
        prompts, params, progress=False)]
    engine = minidsa.Engine(tiny_model, max_num_seqs=max_num_seqs)
    if shaped:
        engine.runner.step_graphs = StepGraphs(tiny_model, engine.cache, max_num_seqs, eager=True)
    blocks, slots = engine.cache.num_free_blocks, engine.cache.num_free_state_slots
    steps, tokens = [], []  # the warm-up's steps, and its forwards seen from the decoder (they must have run)
    prepare = runner_module.prepare_step
    monkeypatch.setattr(runner_module, "prepare_step", lambda *a, **k: steps.append(k) or prepare(*a, **k))
    hook = tiny_model.language_model.model.register_forward_hook(lambda mod, args, out: tokens.append(out.shape[1]))
    try:
        engine.runner.warm_up(engine.max_num_batched_tokens)
    finally:
        hook.remove()
    monkeypatch.undo()
    decode = 1 if max_num_seqs > 2 else 0
    # tiny: max_seq_len 256, so one step of pieces of 255 and 127 tokens; the KDA chunk is 16
    assert [k["keep"] for k in steps] == [[(decode, 16 * (127 // 16))]]
    if shaped:
        shape = steps[0]["shape"]
        assert (shape.decode_rows, shape.pieces, shape.piece_len, shape.kept) == (decode, 2, 256, 1)
        assert tokens == [shape.num_tokens]
    else:
        assert steps[0]["shape"] is None and tokens == [decode + 255 + 127]
    assert (engine.cache.num_free_blocks, engine.cache.num_free_state_slots) == (blocks, slots)
    fresh = minidsa.Engine(tiny_model, max_num_seqs=max_num_seqs).cache
    assert engine.cache._free == fresh._free and engine.cache._free_state_slots == fresh._free_state_slots  # in order
    assert engine.cache.sequences() == []
    assert [o.token_ids for o in engine.generate(prompts, params, progress=False)] == want


def test_the_compiled_decode_step_makes_lazy_state_before_tracing(tiny_model, monkeypatch):
    """``compile_decode`` traces the decode step with Dynamo, which cannot enter the lock that guards the lazily made
    expert workspace, so in a fresh process ``capture`` must make such state with one eager step before the first
    compile (the capture itself needs a GPU and is replaced here)."""
    from minidsa.serving.cuda_graphs import DecodeGraphs
    model = minidsa.MiniDSA(tiny_model.config)
    assert model._workspace is None
    graphs = DecodeGraphs(model, model.new_cache(), 2, compile=True)
    captured = []
    monkeypatch.setattr(graphs, "_capture", captured.append)
    graphs.capture()
    assert model._workspace is not None and captured == [2, 1]



@pytest.mark.slow  # four decode steps of tiny, traced by Dynamo and run in Triton's interpreter: a few minutes
def test_compiled_decode_buckets_share_one_dynamic_compile(tiny_model):
    """``compile_decode`` compiles each bucket's step with Dynamo's automatic dynamic shapes: the first bucket for its
    size, the second again with the batch symbolic, later buckets reusing that, and one row apart (a size-1 dimension
    always specialises), and a second call on the same context (as a capture's warm-up makes) reuses its graph: a
    compile per bucket would take minutes at a cold engine start. Dynamo's graphs are
    counted by a backend that runs them as they are (Inductor's code generation is the GPU's part)."""
    pytest.importorskip("triton")
    from minidsa.serving.cuda_graphs import DecodeGraphs
    model = tiny_model if kernel_device() == "cpu" else minidsa.load("tiny", device="cuda")
    graphs = DecodeGraphs(model, model.new_cache(), 4, compile=True)
    compiled = []

    def count(gm, example_inputs):
        compiled.append(len(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.inference_mode(), minidsa.ops.use_backend("triton"):
            for rows in (4, 3, 2, 1):
                ctx = padded_decode_context(graphs.cache, [], rows, graphs.max_blocks, model.device)
                step = graphs.step(torch.zeros(rows, 1, dtype=torch.long, device=model.device), ctx, backend=count)
                for _ in range(2 if rows == 4 else 1):  # a capture calls its step again on the same context
                    logits = step()
                assert logits.shape[0] == rows and torch.isfinite(logits).all()
    finally:
        torch._dynamo.reset()
    assert len(compiled) == 3  # 4 rows; 3 rows with the batch symbolic, reused for 2; 1 row
