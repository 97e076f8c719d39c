"""The engine against the plain model: every scheduling mix gives each prompt's greedy tokens alone.

The reference is the uncached forward ``model(ids)`` run again over the whole sequence for every new token:
it shares no cache, scheduler or prefix code with the engine. The model is the shipped one in fp64, so a
batch, a chunk or a restored state changes the logits by ~1e-15 and an argmax cannot flip on rounding.
"""

import pytest
import torch

import minidsa
from minidsa import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def alone(model, ids: list[int], n: int, image_features=()) -> list[int]:
    """Greedy continuation by full recomputation, no cache (image features fill the media positions)."""
    out = []
    with torch.inference_mode():
        for _ in range(n):
            embeds = model.embed(torch.tensor([ids + out]), image_features)
            logits = model(inputs_embeds=embeds)[0, -1].clone()
            logits[model.tokenizer.vocab_size:] = float("-inf")
            out.append(int(torch.argmax(logits)))
    return out


@pytest.fixture(scope="module")
def model():
    """The shipped trained weights in fp64 (trained, so its KDA states matter to the next token)."""
    trained = minidsa.load("default", progress=False)
    model = minidsa.MiniDSA(trained.config.replace(dtype="float64"), init=False)
    model.load_state_dict(trained.state_dict())
    return model


def text_of_len(n: int, salt: int = 0) -> str:
    """A prompt of exactly n tokens (bos + n - 1 bytes)."""
    return "".join(chr(97 + (7 * i + salt) % 26) for i in range(n - 1))


# top-k is 8 on tiny: prompts shorter than, equal to and one longer than it, then chunk-sized and longer
PROMPTS = [text_of_len(n, s) for s, n in enumerate((7, 8, 9, 16, 17, 40, 70))]


@pytest.fixture(scope="module")
def expected(model):
    return [alone(model, model.tokenizer.encode(p), GREEDY.max_tokens) for p in PROMPTS]


MIXES = {
    "defaults": {},
    "budget one chunk": dict(max_num_batched_tokens=16),
    "one sequence at a time": dict(max_num_seqs=1),
    "no chunked prefill": dict(enable_chunked_prefill=False),
    "no prefix caching": dict(enable_prefix_caching=False),
    "cache too small: preemption": dict(num_blocks=14, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("mix", MIXES)
def test_greedy_outputs_equal_each_prompt_alone(model, expected, mix):
    engine = Engine(model, **MIXES[mix])
    outs = engine.generate(PROMPTS, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    stats = engine.stats()
    if mix.startswith("cache too small"):
        assert stats["num_preemptions"] > 0  # the mix must really preempt
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert engine.cache.num_free_state_slots == engine.cache.layout.num_state_slots


def test_each_token_is_fed_exactly_once(model, monkeypatch):
    """The token sampled at the end of a prefill is the next step's input, once: the ids the model is fed
    per sequence are the prompt and the output without its last token, in order, with no repeat."""
    engine = Engine(model, max_num_batched_tokens=16, enable_prefix_caching=False)
    fed: dict[int, list[int]] = {}
    embeddings = engine.runner.embeddings

    def recording(pieces):  # the ids of every piece of a step, as the packed forward embeds them
        for req, a, b in pieces:
            fed.setdefault(req.sid, []).extend(req.tokens(a, b))
        return embeddings(pieces)
    monkeypatch.setattr(engine.runner, "embeddings", recording)
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS[3:6]]
    sids = {}
    while engine.has_unfinished_requests():
        sids.update({r.request_id: r.sid for r in engine.scheduler.running})
        outs = {o.request_id: o for o in engine.step()}
        for rid, o in outs.items():
            if o.finished:
                assert fed[sids[rid]] == o.prompt_token_ids + o.token_ids[:-1]
    assert len(sids) == len(rids)


def test_prefill_equals_shorter_prefill_plus_decode_steps(model):
    """prefill(T) == prefill(T - k) + k one-token steps: logits, KV planes and KDA states."""
    ids = model.tokenizer.encode(text_of_len(37))
    cache = model.new_cache()
    a, b = cache.add_sequence(), cache.add_sequence()
    with torch.inference_mode():
        one_shot = model(torch.tensor([ids]), cache=cache, seq_ids=[a])[0, -1]
        model(torch.tensor([ids[:-5]]), cache=cache, seq_ids=[b])
        for t in ids[-5:]:
            stepped = model(torch.tensor([[t]]), cache=cache, seq_ids=[b])[0, -1]
    torch.testing.assert_close(stepped, one_shot, rtol=0, atol=1e-10)  # fp64: both sums of the same terms
    for layer in range(cache.layout.num_layers):
        for name in cache.layout.plane_names:
            rows = [cache.plane(layer, name).flatten(0, 1)[cache.kv_slots(s, torch.arange(len(ids)))] for s in (a, b)]
            torch.testing.assert_close(rows[1], rows[0], rtol=0, atol=1e-10)
    for sa, sb in zip(cache.snapshot_state(a), cache.snapshot_state(b)):
        for name in sa:
            torch.testing.assert_close(sb[name], sa[name], rtol=0, atol=1e-10)


# ------------------------------------------------------------------ prefix caching
SHARED = text_of_len(40, 3)  # 40 tokens: two 16-token KDA checkpoints, five full 8-token blocks
EVERY_CHUNK = dict(checkpoint_interval=16)  # a checkpoint at every KDA chunk (the default is 64 tokens here)


def test_a_prefix_hit_equals_recomputing(model):
    engine = Engine(model, **EVERY_CHUNK)
    prompts = [SHARED + " first question", SHARED + " second one"]
    engine.generate(prompts[:1], GREEDY, progress=False)
    out = engine.generate(prompts[1:], GREEDY, progress=False)[0]
    assert out.token_ids == alone(model, model.tokenizer.encode(prompts[1]), GREEDY.max_tokens)
    s = engine.stats()
    assert s["prefix_cache_hits"] == 32 and out.metrics.num_cached_tokens == 32  # clamped to the 32-token checkpoint
    assert s["prefix_cache_hits_kv"] == 40  # five full blocks matched
    assert s["prefix_cache_queries"] == sum(len(model.tokenizer.encode(p)) for p in prompts)


@pytest.mark.parametrize("pool", [None, 1], ids=["default pool", "a pool of one"])
def test_checkpoints_inside_a_piece_cost_no_extra_forward(model, pool):
    """A step keeps the KDA states at the checkpoints inside its pieces as it runs (the chunk form returns
    them), so it stays one forward however many checkpoints a piece crosses; each checkpoint equals the state a
    cache holds after that prefix alone (fp64: rounding ~1e-13). A pool of one entry keeps the deepest."""
    engine = Engine(model, **EVERY_CHUNK, max_checkpoints=pool)
    prompt = SHARED + " first question"  # 55 tokens, one piece: checkpoints at 16, 32 and 48 inside it
    ids = model.tokenizer.encode(prompt)
    req = engine.requests[engine.add_request(prompt, GREEDY)]
    engine.step()
    assert engine.runner.packed_steps == 1 and req.num_computed == len(ids) == 55
    pc, bs = engine.prefix, engine.cache.block_size
    held = (16, 32, 48) if pool is None else (48,)
    assert set(pc.checkpoints) == {req.hashes[c // bs - 1] for c in held}
    for c in held:
        cache = model.new_cache()
        sid = cache.add_sequence()
        with torch.inference_mode():
            model(torch.tensor([ids[:c]]), cache=cache, seq_ids=[sid])
        want, got = cache.snapshot_state(sid), pc._entries[pc.checkpoints[req.hashes[c // bs - 1]]]
        for w, g in zip(want, got):
            for name in w:
                torch.testing.assert_close(g[name], w[name], rtol=0, atol=1e-10)


PASS_KEY = ("the river runs past old town where people walk slowly The pass key of kqz is 40271. "
            "birds sing of morning light on hills far away and the sky is blue\nQ: pass key of kqz?\nA: ")  # README


def test_the_default_interval_gives_the_shipped_model_state_hits():
    """The default once equalled the shipped model's whole context (256 tokens), so no prompt ever reached a
    checkpoint. Now a quarter of it: the README prompt (174 tokens) sent twice resumes from the 128-token one."""
    shipped = minidsa.load("default", progress=False)
    params = SamplingParams(temperature=0, max_tokens=8)
    engine = Engine(shipped)
    assert engine.checkpoint_interval == 64
    first, second = (engine.generate([PASS_KEY], params, progress=False)[0] for _ in range(2))
    s = engine.stats()
    assert s["prefix_cache_hits_kda"] == 128 and second.metrics.num_cached_tokens == 128
    plain = Engine(shipped, enable_prefix_caching=False).generate([PASS_KEY], params, progress=False)[0]
    assert first.token_ids == second.token_ids == plain.token_ids and second.text.startswith("40271")


def test_a_hit_clamps_to_an_earlier_checkpoint_and_diverges_inside_a_block(model):
    """Checkpoints every 32 tokens; the prompts share 44 tokens, so the KV blocks match 40 tokens (the
    sixth block diverges in its middle) but the state exists only at 32: the hit is 32."""
    engine = Engine(model, checkpoint_interval=32)
    first, second = SHARED + "xyzw" + "AAAAAAAAAA", SHARED + "xyzw" + "BBBBBBBBBB"
    engine.generate([first], GREEDY, progress=False)
    out = engine.generate([second], GREEDY, progress=False)[0]
    assert out.token_ids == alone(model, model.tokenizer.encode(second), GREEDY.max_tokens)
    s = engine.stats()
    assert s["prefix_cache_hits_kv"] == 40 and s["prefix_cache_hits"] == s["prefix_cache_hits_kda"] == 32


def prompt_end_logits(engine, prompt: str, monkeypatch) -> torch.Tensor:
    """The logits the engine's first token was drawn from (the last prefill forward's last row)."""
    head = engine.model.language_model.lm_head  # a step computes logits only for the rows it samples
    rows, forward = [], head.forward
    monkeypatch.setattr(head, "forward", lambda *a, **kw: rows.append(forward(*a, **kw)) or rows[-1])
    engine.generate([prompt], GREEDY, progress=False)
    monkeypatch.undo()
    return rows[-GREEDY.max_tokens][-1]  # then max_tokens - 1 one-token decodes


@pytest.mark.parametrize("state", ["restored", "zero (the reported bug)"])
def test_a_hit_resumes_from_its_checkpoint_not_from_zero(model, monkeypatch, state):
    """At the logits: the hit's first token comes from the recomputed logits to fp64 rounding; with the
    restore skipped (a hit resuming the recurrence from the zero state) the same check fails by far."""
    engine = Engine(model, **EVERY_CHUNK)
    engine.generate([SHARED + " first question"], GREEDY, progress=False)
    if state != "restored":
        monkeypatch.setattr(engine.cache, "restore_state", lambda sid, snapshot: None)
    prompt = SHARED + " second one"
    got = prompt_end_logits(engine, prompt, monkeypatch)
    assert engine.stats()["prefix_cache_hits"] == 32
    with torch.inference_mode():
        want = model(torch.tensor([model.tokenizer.encode(prompt)]))[0, -1]
    diff = float((got - want).abs().max())
    assert (diff < 1e-9) == (state == "restored"), diff  # fp64 rounding is ~1e-13; a wrong state moves it ~1


def test_images_are_part_of_a_prefix(model):
    rng = torch.Generator().manual_seed(0)
    im1, im2 = (torch.randint(0, 256, (32, 32, 3), generator=rng, dtype=torch.uint8).numpy() for _ in range(2))
    engine = Engine(model, **EVERY_CHUNK)
    marker = minidsa.tokenizer.IMAGE_MARKER
    engine.generate([marker + SHARED + " one"], GREEDY, images=[[im1]], progress=False)
    out = engine.generate([marker + SHARED + " two"], GREEDY, images=[[im1]], progress=False)[0]
    hits = engine.stats()["prefix_cache_hits"]
    assert hits > 0
    engine.generate([marker + SHARED + " one"], GREEDY, images=[[im2]], progress=False)
    assert engine.stats()["prefix_cache_hits"] == hits  # another image: no block of it matches
    feats = model.encode_images(model.prepare_images([im1]))
    assert out.token_ids == alone(model, out.prompt_token_ids, GREEDY.max_tokens, feats)


# ------------------------------------------------------------------ abort, failures, bad input
def all_free(engine) -> bool:
    cache = engine.cache
    held = engine.prefix.num_evictable() if engine.prefix else 0
    return (cache.num_free_blocks + held == cache.layout.num_blocks and not cache.sequences()
            and cache.num_free_state_slots == cache.layout.num_state_slots)


@pytest.mark.parametrize("when", ["mid-prefill", "mid-decode"])
def test_abort_frees_every_block_and_slot(model, when):
    engine = Engine(model, max_num_batched_tokens=16)
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS[4:]]
    target = rids[-1]  # the 70-token prompt: several steps of prefill at 16 tokens a step
    req = engine.requests[target]
    while not (0 < req.num_computed < len(req.prompt_ids) if when == "mid-prefill" else req.output_ids):
        engine.step()
    engine.abort(target)
    engine.generate(["after"], GREEDY, progress=False)
    while engine.has_unfinished_requests():
        engine.step()
    assert all_free(engine)
    with pytest.raises(ValueError, match="unknown request id"):
        engine.abort(target)


def test_a_failing_request_leaves_the_others_and_the_engine_usable(model, expected, monkeypatch):
    engine = Engine(model, max_num_seqs=1)
    head = model.language_model.lm_head  # fails after every layer ran (and staged its state)
    forward = head.forward
    calls = []

    def fail_first(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device fell over")
        return forward(*a, **kw)
    monkeypatch.setattr(head, "forward", fail_first)
    outs = engine.generate(PROMPTS[:2], GREEDY, progress=False)
    assert outs[0].finish_reason == "error" and "device fell over" in outs[0].error
    assert outs[1].token_ids == expected[1]
    assert all_free(engine)


def run_to_the_end(engine) -> dict:
    """Step until every request finished; their final outputs by request id."""
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return final


def poison(engine, monkeypatch, victim, column: int, value: float) -> None:
    """The engine's packed forwards with ``value`` put at ``column`` of every logits row of ``victim``."""
    forward = engine.runner.forward_packed

    def poisoned(pieces, sample, trace, keep=()):
        logits = forward(pieces, sample, trace, keep)
        for k, i in enumerate(sample):
            if pieces[i][0] is victim:
                logits[k, column] = value
        return logits
    monkeypatch.setattr(engine.runner, "forward_packed", poisoned)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_logits_fail_their_request_only(model, expected, monkeypatch, value):
    """Before, a NaN row was sampled as token 0 and answered garbage as if all were well."""
    engine = Engine(model)
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS[3:7]]
    victim = engine.requests[rids[-1]]  # 70 tokens: a KDA checkpoint at 64 and eight named blocks
    poison(engine, monkeypatch, victim, 5, value)
    final = run_to_the_end(engine)
    bad = final[victim.request_id]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error.startswith("the logits of this request's last position hold NaN or inf (1 of 263 values)")
    assert "python -m minidsa doctor" in bad.error
    assert [final[r].token_ids for r in rids[:-1]] == expected[3:6]
    assert all(final[r].finish_reason == "length" for r in rids[:-1])
    monkeypatch.undo()
    hits = engine.stats()["prefix_cache_hits_kv"]
    again = engine.generate(PROMPTS[6], GREEDY, progress=False)[0]
    assert again.token_ids == expected[6] and again.finish_reason == "length"
    assert engine.stats()["prefix_cache_hits_kv"] == hits  # what the failed request wrote was not kept for reuse
    assert all_free(engine)


def test_the_padding_ids_past_the_vocabulary_are_not_checked(model, expected, monkeypatch):
    """The embedding table has more rows than the tokenizer has ids; those logits are masked, never sampled."""
    engine = Engine(model)
    rid = engine.add_request(PROMPTS[5], GREEDY)
    assert model.config.vocab_size > model.tokenizer.vocab_size
    poison(engine, monkeypatch, engine.requests[rid], model.tokenizer.vocab_size, float("nan"))
    out = run_to_the_end(engine)[rid]
    assert out.finish_reason == "length" and out.token_ids == expected[5]


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_generate_raises_on_non_finite_logits_and_stays_usable(model, monkeypatch, temperature):
    cache = model.new_cache()
    kw = dict(max_new_tokens=4, temperature=temperature, seed=3, cache=cache, stop_at_eos=False)
    before = minidsa.generate(PROMPTS[4:6], model, **kw)
    head = model.language_model.lm_head
    forward = head.forward
    calls = []

    def nan_on_the_second_forward(*a, **kw):  # the prefill goes well, the first decode step does not
        calls.append(1)
        logits = forward(*a, **kw)
        return logits.fill_(float("nan")) if len(calls) == 2 else logits
    monkeypatch.setattr(head, "forward", nan_on_the_second_forward)
    with pytest.raises(minidsa.serving.NonFiniteLogitsError, match=r"hold NaN or inf \(263 of 263 values\)") as e:
        minidsa.generate(PROMPTS[4:6], model, **kw)
    assert isinstance(e.value, RuntimeError)
    assert cache.sequences() == [] and cache.num_free_blocks == cache.layout.num_blocks
    monkeypatch.undo()
    assert minidsa.generate(PROMPTS[4:6], model, **kw) == before


BAD = [
    (lambda: SamplingParams(max_tokens=-1), ValueError, "max_tokens = -1"),
    (lambda: SamplingParams(top_p=1.5), ValueError, r"top_p = 1.5 must be in \(0, 1\]"),
    (lambda: SamplingParams(top_k=-2), ValueError, "top_k = -2"),
    (lambda: SamplingParams(temperature=float("nan")), ValueError, "temperature"),
    (lambda: SamplingParams(stop=[""]), ValueError, "empty string"),
    (lambda: SamplingParams(seed="1"), TypeError, "seed"),
]


@pytest.mark.parametrize("make, exc, msg", BAD)
def test_bad_sampling_params_name_the_field(make, exc, msg):
    with pytest.raises(exc, match=msg):
        make()


def test_bad_requests_are_refused_before_anything_is_queued(model):
    engine = Engine(model, num_blocks=8)
    # Each error names the argument to fix as its field (what the service reports as the 400's "param").
    with pytest.raises(ValueError, match="can never fit") as e:
        engine.add_request("x" * 60, SamplingParams(max_tokens=10))  # 8 blocks hold 64 tokens
    assert e.value.field == "max_tokens"
    with pytest.raises(ValueError, match="use max_tokens <= 55") as e:
        engine.add_request("x" * 200, SamplingParams(max_tokens=56))
    assert e.value.field == "max_tokens"
    with pytest.raises(ValueError, match="leaves no room") as e:
        engine.add_request("x" * 300, SamplingParams(max_tokens=1))
    assert e.value.field == "prompt"
    with pytest.raises(TypeError, match="images must be") as e:
        engine.add_request("x", GREEDY, images="cat.png")
    assert e.value.field == "images"
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("x", {"max_tokens": 3})
    rid = engine.add_request("x", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", GREEDY, request_id=rid)
    assert [r.request_id for r in engine.scheduler.waiting] == [rid]
    with pytest.raises(ValueError, match="without chunked prefill"):
        Engine(model, enable_chunked_prefill=False, max_num_batched_tokens=64)


# ------------------------------------------------------------------ sampling, stop, metrics
def test_seeded_sampling_is_reproducible_and_stop_strings_end_the_text(model):
    sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=12, seed=5, ignore_eos=True)
    a = Engine(model).generate(PROMPTS[:3], sp, progress=False)
    b = Engine(model, max_num_seqs=1).generate(PROMPTS[:3], sp, progress=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    text = a[0].text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].isprintable()), None)
    if stop is not None:
        out = Engine(model).generate(PROMPTS[0], SamplingParams(**{**sp.__dict__, "stop": [stop]}), progress=False)[0]
        assert out.finish_reason == "stop" and out.text == text[:text.find(stop)]


def test_metrics_add_up(model):
    engine = Engine(model, max_num_batched_tokens=16, enable_prefix_caching=False)
    outs = engine.generate(PROMPTS, GREEDY, progress=False)
    s = engine.stats()
    assert s["generation_tokens"] == sum(len(o.token_ids) for o in outs)
    assert s["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    for o in outs:
        m = o.metrics
        assert len(m.token_times) == len(o.token_ids) and len(m.itl) == len(o.token_ids) - 1
        assert m.tpot == pytest.approx((m.e2e - m.ttft) / (len(o.token_ids) - 1))
        assert 0 <= m.queue_time <= m.ttft <= m.e2e
        assert m.ttft == pytest.approx(m.token_times[0] - m.arrival_time)
    assert s["kv_cache_usage_perc"] == 0 and s["kda_state_usage_perc"] == 0


def test_the_memory_budget_counts_every_pool_and_names_its_bound(model):
    engine = Engine(model)
    plan = engine.stats()["memory"]
    fixed = sum(v for k, v in plan.items() if k.endswith("_bytes") and k not in ("kv_block_bytes", "total_bytes", "memory_bytes"))
    assert plan["indexer_scores_bytes"] > 0 and plan["kda_checkpoint_bytes"] > 0 and plan["expert_workspace_bytes"] > 0
    sized = Engine(model, memory_bytes=fixed + 20 * plan["kv_block_bytes"] + 1)
    assert sized.cache.layout.num_blocks == 20 and sized.stats()["memory"]["bound"] == "memory"
    roomy = Engine(model, max_num_seqs=2, memory_bytes=10**9)
    assert roomy.cache.layout.num_blocks == 2 * 256 // 8 and roomy.stats()["memory"]["bound"] == "max_num_seqs x max_seq_len"
    with pytest.raises(ValueError, match="leaves no room for a KV block"):
        Engine(model, memory_bytes=fixed)


def test_bench_prints_the_vllm_fields(capsys):
    from minidsa.cli import main
    argv = ["bench", "--config", "default", "--num-requests", "3", "--input-len", "10", "30", "--output-len", "2", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for field in ("Successful requests:                             3", "Output token throughput (tok/s):",
                  "Median TTFT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "Preemptions:",
                  "Engine / sequential throughput:"):
        assert field in out, field


def test_a_listener_sees_every_call_that_changes_the_run_and_can_mirror_it(model):
    """Engine.add_listener: queued requests (with the seed they sample with), aborts and steps, in order. A
    second engine fed those calls runs the same steps and samples the same tokens, sampled rows included."""
    class Mirror:
        def __init__(self, engine):
            self.engine, self.calls = engine, []

        def queued(self, prompt, ids, features, params, request_id):
            self.calls.append(("queued", request_id, params.seed))
            self.engine.enqueue(prompt, ids, features, params, request_id)

        def aborted(self, request_id):
            self.calls.append(("aborted", request_id))
            self.engine.abort(request_id)

        def stepping(self):
            self.calls.append(("stepping",))
            self.outs.append(self.engine.step())

    lead, other = Engine(model, max_num_seqs=2), Engine(model, max_num_seqs=2)
    mirror = Mirror(other)
    mirror.outs = []
    lead.add_listener(mirror)
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)  # no seed: the engine draws one
    a = lead.add_request(text_of_len(20), params)
    b = lead.add_request(text_of_len(30, 1), params)
    mine = [lead.step()]
    lead.abort(b)
    while lead.has_unfinished_requests():
        mine.append(lead.step())
    assert mirror.calls[:3] == [("queued", a, mirror.calls[0][2]), ("queued", b, mirror.calls[1][2]), ("stepping",)]
    assert mirror.calls[0][2] is not None and mirror.calls[3] == ("aborted", b)
    assert len(mirror.calls) == 2 + len(mine) + 1 and not other.has_unfinished_requests()
    tokens = [[(o.request_id, list(o.token_ids)) for o in step] for step in mine]
    assert tokens == [[(o.request_id, list(o.token_ids)) for o in step] for step in mirror.outs]
