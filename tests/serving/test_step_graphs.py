"""A step laid out to a fixed StepShape (what a captured graph replays: decode rows and the prefill rectangle
padded, every padding row at position -1, slot -1, state slot 0) equals the same step packed tight, and
the engine's steps through StepGraphs (eager here: no GPU) give the engine's own outputs.

Compared in float64 on the CPU to 1e-12 relative, for the reason test_packed_step.py gives (the BLAS rounds a
product's rows differently with its row count, and a shaped step multiplies more rows); a wrong slot, state,
row or mask costs O(1). Selections are integers and must be equal.
"""

import pytest
import torch
from conftest import tiny_config
from test_packed_step import MIXES, close, two_caches

import minidsa
from minidsa.cache import StepShape, prepare_step
from minidsa.serving.engine import Engine
from minidsa.serving.step_graphs import StepGraphs, _round_len


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return minidsa.MiniDSA(tiny_config(dtype="float64"))


def run_step(model, cache, sids, embeds, shape=None, keep=(), kept=None):
    """Every piece's token logits [N, V] (piece order) and the selections of each piece, from one forward
    (``kept``: a list that receives the step's kept KDA states)."""
    step = prepare_step(cache, sids, [e.shape[0] for e in embeds], model.device, model.config.max_seq_len,
                        shape=shape, keep=keep)
    x = embeds[0].new_zeros(1, step.num_tokens, model.config.hidden_size)
    spans = [step.span(i) for i in range(len(sids))]
    for (a, b), e in zip(spans, embeds):
        x[0, a:b] = e
    trace = minidsa.ForwardTrace()
    with torch.inference_mode():
        hidden = model.language_model.model(x, step, trace)
        logits = model.language_model.lm_head(hidden[0])
    step.publish()
    if kept is not None:
        kept.extend(step.kept)
    rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(x.device)
    return logits[rows], {k: v[0, rows] for k, v in trace.selected.items()}


def shape_of(lengths, extra_rows=1, extra_len=5, width=16):
    d = sum(1 for n in lengths if n == 1)
    p = [n for n in lengths if n > 1]
    return StepShape(d + extra_rows, len(p) + extra_rows, max(p, default=1) + extra_len, width,
                     tokens=sum(p) + extra_len)  # a few padding tokens after the packed pieces


@pytest.mark.parametrize("mix", [m for m in MIXES if m != "decode only"])
def test_a_shaped_step_equals_the_tight_one(model, mix):
    history, lengths = zip(*MIXES[mix])
    (cache_s, sids_s), (cache_t, sids_t) = two_caches(model, list(history))
    torch.manual_seed(2)
    embeds = [torch.randn(n, model.config.hidden_size, dtype=torch.float64) for n in lengths]
    shaped, sel_s = run_step(model, cache_s, sids_s, embeds, shape_of(lengths))
    tight, sel_t = run_step(model, cache_t, sids_t, embeds)
    assert close(shaped, tight)
    for layer in sel_t:
        assert torch.equal(sel_s[layer], sel_t[layer]), layer
    for ss, st in zip(sids_s, sids_t):
        assert cache_s.seq_len(ss) == cache_t.seq_len(st)
    for planes_s, planes_t in zip(cache_s.storage, cache_t.storage):  # same tables: the same slots
        for name in planes_s:
            assert close(planes_s[name].double(), planes_t[name].double()), name
    for states_s, states_t in zip(cache_s.state, cache_t.state):  # state slot 0 included: padding wrote nothing
        for name in states_s:
            assert close(states_s[name], states_t[name]), name


def test_a_step_must_fit_its_shape_and_a_refusal_reserves_nothing(model):
    cache = model.new_cache()
    sids = [cache.add_sequence() for _ in range(2)]
    with pytest.raises(ValueError, match="does not fit"):
        prepare_step(cache, sids, [1, 40], model.device, shape=StepShape(1, 1, 32, 16))
    assert cache.num_free_blocks == cache.layout.num_blocks
    template = prepare_step(cache, [], [], model.device, shape=StepShape(1, 1, 32, 16))
    with pytest.raises(ValueError, match="same shape"):
        prepare_step(cache, sids, [1, 20], model.device, shape=StepShape(2, 1, 32, 16), into=template)
    assert cache.num_free_blocks == cache.layout.num_blocks


def test_shapes_round_up_to_few_sizes(model):
    assert [_round_len(n) for n in (1, 16, 17, 25, 33, 49, 65, 97, 129, 1000, 1025)] == \
        [16, 16, 24, 32, 48, 64, 96, 128, 192, 1024, 1536]
    cache = model.new_cache()
    graphs = StepGraphs(model, cache, 8, eager=True)
    sids = [cache.add_sequence() for _ in range(4)]
    assert graphs.shape_for(sids[:2], [1, 1]) is None  # decode only: the decode graphs' work
    width = 1
    while width * cache.block_size < 100:  # the table of a 100-token sequence, a power of two of blocks
        width *= 2
    assert graphs.shape_for(sids, [1, 1, 1, 100]) == StepShape(4, 1, 128, min(width, graphs.max_blocks), tokens=128)
    # Prefill tokens packed: 130 of them on 192 places of the axis, the rectangle 2 x 128 = 256 places.
    assert graphs.shape_for(sids[:2], [100, 30]).tokens == 192
    sids += [cache.add_sequence() for _ in range(4)]
    assert graphs.shape_for(sids, [1000] + [5] * 7) is None  # 8 x 1,024 places would hold 7.9x the 1,035 tokens
    assert graphs.decode_buckets == [0, 1, 2, 4, 8]


def test_a_shape_is_captured_at_its_capture_after_th_step_and_runs_shaped_before(model, monkeypatch):
    shape = StepShape(1, 1, 16, 2)
    for after in (1, 2, 3):
        graphs = StepGraphs(model, model.new_cache(), 8, capture_after=after)
        captured = []
        monkeypatch.setattr(graphs, "_capture", lambda s: captured.append(graphs.sightings[s]) or
                            graphs.graphs.__setitem__(s, None))
        assert [graphs.ready(shape) for _ in range(4)] == [True] * 4 and captured == [after]


def test_a_shape_whose_capture_fails_runs_eagerly_from_then_on(model, monkeypatch):
    graphs, shape = StepGraphs(model, model.new_cache(), 8), StepShape(1, 1, 16, 2)

    def fails(s):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(graphs, "_capture", fails)
    with pytest.warns(UserWarning, match="no CUDA graph"):
        assert [graphs.ready(shape) for _ in range(3)] == [True, False, False]
    assert "not permitted" in graphs.failed[shape]


def test_the_engine_through_step_graphs_gives_its_own_outputs(model):
    """Greedy outputs of a workload with mixed steps, chunked prompts, a prefix hit and pieces of different
    lengths: the engine's eager steps against the same engine whose prefill steps run shaped (StepGraphs,
    eager), which must have run some of them."""
    prompts = ["the first prompt", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3, "x",
               "the first prompt and then some more"]
    params = minidsa.SamplingParams(temperature=0, max_tokens=6)
    want = [o.text for o in Engine(model, max_num_batched_tokens=64).generate(prompts, params, progress=False)]
    for eager in (True, False):  # shaped as an eager StepGraphs runs them, and as shapes not yet captured
        engine = Engine(model, max_num_batched_tokens=64)
        engine.runner.step_graphs = graphs = StepGraphs(model, engine.cache, engine.scheduler.max_num_seqs,
                                                        eager=eager, capture_after=10**9)
        got = [o.text for o in engine.generate(prompts, params, progress=False)]
        assert got == want
        assert (graphs.replays if eager else graphs.uncaptured) > 0 and graphs.captures == 0
        assert engine.runner.step_times["step shaped, uncaptured"][0] > 0


def test_states_kept_inside_pieces_equal_the_prefixes_alone(model):
    """``keep``: the KDA states (recurrent and conv) after t tokens of a prefill piece, which the prefix cache
    keeps without cutting the step there, from a shaped step (one padding pair) and a tight one, against the
    state each sequence holds after a step that stops at t. Offsets are multiples of tiny's 16-token chunk."""
    history, lengths = [9, 24, 0], [1, 40, 37]
    keep = [(2, 32), (1, 16), (1, 32), (2, 16)]  # out of piece order
    torch.manual_seed(2)
    embeds = [torch.randn(n, model.config.hidden_size, dtype=torch.float64) for n in lengths]
    got = []
    for shape in (StepShape(2, 3, 48, 16, kept=8), None):
        (cache, sids), _ = two_caches(model, history)
        kept = []
        run_step(model, cache, sids, embeds, shape, keep, kept)
        got.append(kept)
    for m, (i, t) in enumerate(keep):
        (cache, sids), _ = two_caches(model, history)
        run_step(model, cache, [sids[i]], [embeds[i][:t]])
        want = cache.snapshot_state(sids[i])
        for kept in got:
            for layer, name, states in kept:
                assert close(states[m], want[layer][name]), (m, layer, name)
    assert all(states.shape[0] == 8 for _, _, states in got[0]) and all(s.shape[0] == 4 for _, _, s in got[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (the GPU acceptance script runs this)")
def test_a_replayed_step_equals_the_eager_shaped_step_bit_for_bit():
    """Two different steps of one shape through one captured graph, against the same steps run eagerly with the
    same kernels (the absorbed sparse prefill, as in the graph): logits, KDA states and the states kept inside
    a piece identical, so the metadata of the second step really replaced the first's. The same with the shape
    captured at its second step: the first runs shaped and uncaptured, and nothing tells the two apart."""
    from minidsa.ops.mla.prefill_form import sync_free
    torch.manual_seed(0)
    model = minidsa.MiniDSA(tiny_config(dtype="float32"), device="cuda").set_backend("triton")
    # (history, piece lengths): one shape (2 pieces of at most 24, 32 prefill tokens on the axis, one table width)
    steps = [([6, 0, 0], [1, 20, 9]), ([30, 3, 0], [1, 17, 9])]
    results, shapes = [], {}
    for graphed, after in ((True, 1), (True, 2), (False, 1)):
        cache = model.new_cache()
        graphs = StepGraphs(model, cache, 4, eager=not graphed, capture_after=after)
        sids = [cache.add_sequence() for _ in range(3)]
        out = []
        for history, lengths in steps:
            for s in sids:
                cache.free(s)
            sids = [cache.add_sequence() for _ in range(3)]
            torch.manual_seed(1)
            with torch.inference_mode(), sync_free():
                for sid, n in zip(sids, history):
                    if n:
                        model(torch.randint(1, 200, (1, n), device="cuda"), cache=cache, seq_ids=[sid])
                shape = graphs.shape_for(sids, lengths, 1)
                assert shape is not None and shape == shapes.setdefault(graphed, shape)  # the premise: one shape
                assert graphs.ready(shape)
                ids = torch.randint(1, 200, (sum(lengths),)).tolist()
                logits, kept = graphs.run(shape, sids, lengths, ids, [0, 1, 2], [(1, 16)])
                out.append(logits.clone())
                assert len(kept) == 2 * len(cache.state)  # recurrent and conv of each KDA layer, once
                out += [states[:1].clone() for _, _, states in kept]
            out += [cache.state[0][name][cache.state_slots(sids)].clone() for name in cache.state[0]]
        results.append(out)
        assert (graphs.replays, graphs.captures, graphs.uncaptured) == ((3 - after, 1, after - 1) if graphed else
                                                                        (2, 0, 0))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels on a shaped step (a GPU; the CPU tests run "
                                                          "the fp64 references)")
@pytest.mark.parametrize("mix", [m for m in MIXES if m != "decode only"])
def test_the_kernels_give_a_shaped_step_what_they_give_the_tight_one(mix):
    """fp32 on the GPU, backend triton, the same sparse prefill form in both (sync_free): a shaped step's logits
    within 1e-4 of the tight step's (fp32 kernels, different row counts: rounding only; a padding row that
    leaked into a real one, or a mask that missed, costs O(1)) and the same selections."""
    from minidsa.ops.mla.prefill_form import sync_free
    torch.manual_seed(0)
    model = minidsa.MiniDSA(tiny_config(dtype="float32"), device="cuda").set_backend("triton")
    history, lengths = zip(*MIXES[mix])
    out = []
    for shaped in (True, False):
        cache = model.new_cache()
        sids = [cache.add_sequence() for _ in history]
        torch.manual_seed(1)
        with torch.inference_mode(), sync_free(), minidsa.ops.use_backend("triton"):
            for sid, n in zip(sids, history):
                if n:
                    model(inputs_embeds=torch.randn(1, n, model.config.hidden_size, device="cuda"), cache=cache,
                          seq_ids=[sid])
            embeds = [torch.randn(n, model.config.hidden_size, device="cuda") for n in lengths]
            out.append(run_step(model, cache, sids, embeds, shape_of(lengths) if shaped else None))
    (a, sel_a), (b, sel_b) = out
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    for layer in sel_b:
        assert torch.equal(sel_a[layer], sel_b[layer]), layer


def test_a_failed_shaped_step_leaves_the_cache_as_it_was(model, monkeypatch):
    """A forward that raises inside a shaped step gives its blocks back and writes no state; the next step of
    the same shape then runs as if nothing had happened."""
    cache = model.new_cache()
    graphs = StepGraphs(model, cache, 4, eager=True, capture_after=1)
    sids = [cache.add_sequence() for _ in range(2)]
    shape = graphs.shape_for(sids, [1, 20])
    before = [cache.block_table(s) for s in sids], [cache.seq_len(s) for s in sids], cache.num_free_blocks
    states = [t.clone() for layer in cache.state for t in layer.values()]

    def broken(step, ids):
        raise RuntimeError("a kernel failed")
    with monkeypatch.context() as m:
        m.setattr(graphs, "_forward", broken)
        with pytest.raises(RuntimeError, match="kernel failed"), torch.inference_mode():
            graphs.run(shape, sids, [1, 20], list(range(1, 22)), [0, 1])
    assert ([cache.block_table(s) for s in sids], [cache.seq_len(s) for s in sids], cache.num_free_blocks) == before
    assert all(torch.equal(a, b) for a, b in zip(states, [t for layer in cache.state for t in layer.values()]))
    with torch.inference_mode():
        logits, _ = graphs.run(shape, sids, [1, 20], list(range(1, 22)), [0, 1])
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()
    assert [cache.seq_len(s) for s in sids] == [1, 20]
