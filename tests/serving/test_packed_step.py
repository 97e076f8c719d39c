"""One packed forward (an engine step: pieces of several sequences on one token axis, decode rows first)
equals the rectangle forward (``model(x, cache=..., seq_ids=...)``, the reference), piece by piece: the
logits of every token, the cache rows written (latent, k_pe and indexer planes), the KDA recurrent and
conv states, and the DSA selections, for every scheduling mix.

Compared in float64 on the CPU. Bit equality is not available even there: the CPU BLAS rounds a row of a
product differently with the number of rows in the call (``F.linear`` of 1, 2, 3 or 7 rows differs in the
last bit from the same rows inside 200, measured with MKL), and a packed step multiplies all N tokens at
once where the rectangle multiplies one piece. So the values must agree to fp64 rounding (1e-12 relative:
a few hundred roundings of 1.1e-16 through the depth of the model), while any wrong key, slot, state or
piece boundary costs O(1). The selections are integers and must be equal.
"""

import os

import pytest
import torch
from conftest import tiny_config, with_indexer

import minidsa
from minidsa.cache import prepare_step
from minidsa.serving.engine import Engine

TOL = 1e-12  # relative, fp64 (see above)


@pytest.fixture(scope="module", params=["exact indexer", "fp8 indexer"])
def model(request):
    torch.manual_seed(0)
    cfg = tiny_config(dtype="float64")
    if request.param == "fp8 indexer":
        cfg = with_indexer(cfg, fp8=True, hadamard=True)
    return minidsa.MiniDSA(cfg)


def packed_logits(model, cache, sids, embeds, trace=None):
    """Every token's logits [N, V] from one packed forward of ``embeds`` (one [T_i, d] per piece)."""
    step = prepare_step(cache, sids, [e.shape[0] for e in embeds], model.device, model.config.max_seq_len)
    with torch.inference_mode():
        hidden = model.language_model.model(torch.cat(embeds).unsqueeze(0), step, trace)
        logits = model.language_model.lm_head(hidden[0])
    step.publish()
    return logits


def rectangle_logits(model, cache, sids, embeds, traces=None):
    """The same pieces, each its own rectangle forward [1, T_i] -> [N, V]."""
    out = []
    with torch.inference_mode():
        for i, (sid, e) in enumerate(zip(sids, embeds)):
            tr = None if traces is None else traces.setdefault(i, minidsa.ForwardTrace())
            out.append(model(inputs_embeds=e.unsqueeze(0), cache=cache, seq_ids=[sid], trace=tr)[0])
    return torch.cat(out)


def two_caches(model, history: list[int]):
    """Two caches holding the same sequences, sequence i with ``history[i]`` tokens already prefilled."""
    torch.manual_seed(1)
    d = model.config.hidden_size
    dtype = model.language_model.lm_head.weight.dtype
    past = [torch.randn(n, d, dtype=dtype) for n in history]
    caches = []
    for _ in range(2):
        cache = model.new_cache()
        sids = [cache.add_sequence() for _ in history]
        for sid, x in zip(sids, past):
            if x.shape[0]:
                with torch.inference_mode():
                    model(inputs_embeds=x.unsqueeze(0), cache=cache, seq_ids=[sid])
        caches.append((cache, sids))
    return caches


MIXES = {  # per piece: tokens already in the cache, tokens of the piece (decode rows first)
    "decode only": [(5, 1), (17, 1), (40, 1)],
    "prefill only, new sequences": [(0, 37), (0, 20)],
    "mixed": [(9, 1), (33, 1), (32, 29), (0, 5), (16, 16)],
    "pieces shorter than top-k": [(0, 3), (4, 2), (0, 7)],
    "continuing across a KDA chunk": [(12, 1), (24, 21), (48, 40)],
}


def close(a, b):
    scale = max(b.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() <= TOL * scale


@pytest.mark.parametrize("mix", MIXES)
def test_packed_step_equals_the_rectangle_forward(model, mix):
    history, lengths = zip(*MIXES[mix])
    (cache_p, sids_p), (cache_r, sids_r) = two_caches(model, list(history))
    torch.manual_seed(2)
    embeds = [torch.randn(n, model.config.hidden_size, dtype=torch.float64) for n in lengths]
    tp, tr = minidsa.ForwardTrace(), {}
    packed = packed_logits(model, cache_p, sids_p, embeds, tp)
    rect = rectangle_logits(model, cache_r, sids_r, embeds, tr)
    assert close(packed, rect)
    at = 0
    for i, n in enumerate(lengths):  # the selections, token by token
        for layer, sel in tp.selected.items():
            assert torch.equal(sel[0, at:at + n], tr[i].selected[layer][0]), (mix, i, layer)
        at += n
    for sp, sr in zip(sids_p, sids_r):
        assert cache_p.seq_len(sp) == cache_r.seq_len(sr)
        assert cache_p.block_table(sp) == cache_r.block_table(sr)
    for planes_p, planes_r in zip(cache_p.storage, cache_r.storage):  # same tables: the same slots
        for name in planes_p:
            a, b = planes_p[name].double(), planes_r[name].double()
            assert close(a, b), name
    for states_p, states_r in zip(cache_p.state, cache_r.state):
        for name in states_p:
            assert close(states_p[name], states_r[name]), name


def test_a_failed_packed_step_leaves_the_cache_as_it_was(model):
    (cache, sids), _ = two_caches(model, [8, 0])
    before = [cache.block_table(s) for s in sids], [cache.seq_len(s) for s in sids], cache.state[0]["recurrent"].clone()
    head = model.language_model.lm_head
    step = prepare_step(cache, sids, [1, 30], model.device, model.config.max_seq_len)
    x = torch.randn(1, 31, model.config.hidden_size, dtype=torch.float64)
    with torch.inference_mode():
        model.language_model.model(x, step, None)
    step.rollback()  # as the runner does when anything raises before publish
    assert ([cache.block_table(s) for s in sids], [cache.seq_len(s) for s in sids]) == before[:2]
    assert torch.equal(cache.state[0]["recurrent"], before[2])
    assert head is model.language_model.lm_head


@pytest.mark.parametrize("bad, match", [
    (([0, 1], [5, 1]), "decode rows"),
    (([0, 0], [1, 1]), "one piece per sequence"),
    (([0], [0]), ">= 1"),
])
def test_prepare_step_refuses_a_malformed_step(model, bad, match):
    cache = model.new_cache()
    for _ in range(2):
        cache.add_sequence()
    with pytest.raises(ValueError, match=match):
        prepare_step(cache, *bad, model.device)
    assert cache.num_free_blocks == cache.layout.num_blocks  # refused before anything was reserved


def test_an_engine_step_is_one_forward(model):
    """Three prompts of different lengths prefill in one forward (before: one per distinct length), then
    their decodes share one forward per step."""
    engine = Engine(model, enable_prefix_caching=False)
    engine.generate(["a", "a longer prompt", "the longest prompt of the three"],
                    minidsa.SamplingParams(temperature=0, max_tokens=3), progress=False)
    stats = engine.stats()
    assert stats["packed_steps"] == 3
    (steps, seconds), = stats["step_times"].values()  # a CPU engine runs every step eagerly
    assert list(stats["step_times"]) == ["eager"] and steps == 3 and 0 < seconds <= stats["prefill_seconds"] + \
        stats["decode_seconds"]


@pytest.mark.slow  # about 50 s per layer kind in the interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the kernels on CPU tensors need Triton's interpreter; on a GPU the doctor's engine rungs and "
                           "benchmarks/serve_check.py compare packed engine steps with the eager engine")
@pytest.mark.parametrize("kind", ["mla", "kda"])
def test_the_kernels_take_the_packed_step_too(kind):
    """The triton kernels (Triton's interpreter on the CPU) on one attention layer of a mixed, padded step: fp32,
    against the same kernels run piece by piece as rectangles. 1e-5 relative: fp32 rounding of the same
    kernels over different row counts."""
    torch.manual_seed(0)
    model = minidsa.MiniDSA(tiny_config())
    layer = next(x.self_attn for x in model.language_model.model.layers if x.layer_type == kind)
    history, lengths = [9, 0, 16], [1, 5, 3]
    out, caches = [], []
    for packed in (True, False):
        cache = model.new_cache()
        sids = [cache.add_sequence() for _ in history]
        torch.manual_seed(1)
        with torch.inference_mode(), minidsa.ops.use_backend("triton"):
            for sid, n in zip(sids, history):  # the same history in both caches
                if n:
                    ctx = cache.prepare([sid], n, "cpu")
                    layer(torch.randn(1, n, model.config.hidden_size), ctx)
                    ctx.publish()
            xs = [torch.randn(1, n, model.config.hidden_size) for n in lengths]
            if packed:
                step = prepare_step(cache, sids, lengths, "cpu")
                out.append(layer(torch.cat(xs, 1), step)[0])
                step.publish()
            else:
                for sid, x in zip(sids, xs):
                    ctx = cache.prepare([sid], x.shape[1], "cpu")
                    out.append(layer(x, ctx)[0])
                    ctx.publish()
        caches.append(cache)
    rect = torch.cat(out[1:])
    assert (out[0] - rect).abs().max() <= 1e-5 * rect.abs().max()
    mine, ref = caches
    for a, b in zip(mine.storage + mine.state, ref.storage + ref.state):
        for name in a:
            assert (a[name].float() - b[name].float()).abs().max() <= 1e-5 * b[name].float().abs().max(), name
