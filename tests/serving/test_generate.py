import os
import subprocess
import sys

import pytest
import torch

import minidsa
from minidsa.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def greedy_reference(model, prompt, n, stop_at_eos=True):
    """Greedy decoding by re-running the full no-cache forward each step (independent of the cache)."""
    ids = TOK.encode(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out]))[0, -1, : TOK.vocab_size]
            out.append(int(torch.argmax(logits)))
            if stop_at_eos and out[-1] == TOK.eos_id:
                break
    return out


def generated_ids(trace):
    return trace.token_ids[trace.prompt_len:]


def test_greedy_generate_equals_full_forward_argmax(tiny_model64):
    text = minidsa.generate("hello sparse world", tiny_model64, max_new_tokens=20, temperature=0,
                            trace=True)
    trace = text.trace
    ref = greedy_reference(tiny_model64, "hello sparse world", 20)
    assert generated_ids(trace) == ref
    assert text == TOK.decode(ref)
    assert isinstance(text, str)


def test_default_model_and_empty_prompt():
    text = minidsa.generate("", max_new_tokens=5, temperature=0, trace=True, stop_at_eos=False)
    trace = text.trace
    assert trace.token_ids[0] == TOK.bos_id and trace.prompt_len == 1
    assert generated_ids(trace) == greedy_reference(minidsa.default_model(), "", 5, stop_at_eos=False)


def test_sampling_is_seeded_and_streams_the_same_text(tiny_model):
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=7, stop_at_eos=False)
    a = minidsa.generate("abc", tiny_model, **kw)
    b = minidsa.generate("abc", tiny_model, **kw)
    c = minidsa.generate("abc", tiny_model, **{**kw, "seed": 8})
    assert a == b and a != c
    stream = minidsa.stream("abc", tiny_model, **kw)
    pieces = list(stream)
    assert "".join(pieces) == a and len(pieces) > 1 and stream.num_generated == 24


def test_top_p_small_is_greedy(tiny_model):
    greedy = minidsa.generate("xyz", tiny_model, max_new_tokens=10, temperature=0, stop_at_eos=False)
    nucleus = minidsa.generate("xyz", tiny_model, max_new_tokens=10, temperature=1.0, top_p=1e-6, seed=3,
                               stop_at_eos=False)
    assert greedy == nucleus


def test_batch_of_different_lengths_equals_each_alone(tiny_model64):
    prompts = ["", "a", "a longer prompt that crosses several KV blocks"]
    kw = dict(max_new_tokens=12, temperature=0.9, seed=11, stop_at_eos=False)
    texts = minidsa.generate(prompts, tiny_model64, trace=True, **kw)
    traces = [t.trace for t in texts]
    assert isinstance(texts, list) and len(traces) == 3
    for i, p in enumerate(prompts):
        alone = minidsa.generate(p, tiny_model64, trace=True, **{**kw, "seed": 11 + i})
        tr = alone.trace
        assert texts[i] == alone and traces[i].token_ids == tr.token_ids
        for layer in tr.selected:
            assert torch.equal(traces[i].selected[layer].sort(-1).values, tr.selected[layer].sort(-1).values)


def test_trace_covers_every_token_and_matches_full_forward(tiny_model64):
    tiny_model = tiny_model64
    text = minidsa.generate("trace me please", tiny_model, max_new_tokens=10, temperature=0.5, seed=1,
                            trace=True, stop_at_eos=False)
    trace = text.trace
    n = len(trace.token_ids)
    assert n == trace.prompt_len + 10
    mla = tiny_model.config.mla_layers
    assert sorted(trace.selected) == mla
    full = minidsa.ForwardTrace()
    with torch.no_grad():
        tiny_model(torch.tensor([trace.token_ids]), trace=full)
    topk = tiny_model.config.indexer.topk
    for layer in mla:
        sel = trace.selected[layer]
        assert sel.shape == (n, topk) and sel.dtype == torch.int32
        pos = torch.arange(n).unsqueeze(1)
        assert ((sel <= pos) | (sel == -1)).all()
        assert torch.equal(sel.sort(-1).values, full.selected[layer][0].sort(-1).values)
    assert trace.text == text


def test_stop_at_eos(tiny_model, monkeypatch):
    # Make eos the most likely token: generation ends after one token and eos adds no text.
    head = tiny_model.language_model.lm_head
    original = head.forward

    def eos_first(*args, **kwargs):
        logits = original(*args, **kwargs)
        logits[..., TOK.eos_id] = 1e4
        return logits
    monkeypatch.setattr(head, "forward", eos_first)
    text = minidsa.generate("hi", tiny_model, max_new_tokens=8, temperature=0, trace=True)
    trace = text.trace
    assert generated_ids(trace) == [TOK.eos_id] and text == ""
    text = minidsa.generate("hi", tiny_model, max_new_tokens=3, temperature=0, stop_at_eos=False)
    assert text == ""


# ------------------------------------------------------------------ bad input leaves everything usable
BAD_CALLS = [
    (dict(prompt=42), TypeError, "str or a list of str"),
    (dict(prompt=["ok", 3]), TypeError, r"prompt\[1\]"),
    (dict(prompt=[]), ValueError, "empty list"),
    (dict(prompt="x" * 300), ValueError, "301 tokens .* shorten it to at most 255 tokens"),
    (dict(prompt="x" * 255), ValueError, "256 tokens .*leaves no room.* at most 255 tokens"),  # exactly max_seq_len
    (dict(prompt="x" * 254), ValueError, "max_new_tokens <= 1"),
    (dict(prompt="x" * 250, max_new_tokens=20), ValueError, "max_new_tokens <= 5"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens = 0"),
    (dict(max_new_tokens=-3), ValueError, "max_new_tokens = -3"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens"),
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(seed="7"), TypeError, "seed"),
    (dict(model="no-such-config"), ValueError, "unknown config name 'no-such-config'"),
    (dict(model=3), TypeError, "model"),
]


@pytest.mark.parametrize("kwargs, exc, msg", BAD_CALLS)
def test_bad_input_raises_clearly_and_leaves_model_usable(tiny_model, kwargs, exc, msg):
    cache = tiny_model.default_cache()
    before = minidsa.generate("ok", tiny_model, max_new_tokens=6, temperature=0, stop_at_eos=False)
    free = cache.num_free_blocks
    kw = dict(prompt="ok", model=tiny_model, max_new_tokens=4)
    kw.update(kwargs)
    with pytest.raises(exc, match=msg):
        minidsa.generate(kw.pop("prompt"), kw.pop("model"), **kw)
    assert cache.num_free_blocks == free and cache.sequences() == []
    assert minidsa.generate("ok", tiny_model, max_new_tokens=6, temperature=0, stop_at_eos=False) == before


def test_malformed_config_file(tmp_path, tiny_model):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ValueError, match="malformed config JSON"):
        minidsa.generate("x", str(bad), max_new_tokens=2)
    with pytest.raises(ValueError, match="malformed config JSON"):
        minidsa.load(bad)


def test_out_of_kv_blocks_is_clear_and_recoverable(tiny_model):
    cache = tiny_model.new_cache(num_blocks=3)  # 24 tokens of room
    with pytest.raises(minidsa.OutOfKVBlocksError, match="out of blocks"):
        minidsa.generate("a prompt of twenty-five", tiny_model, max_new_tokens=5, cache=cache)
    assert cache.num_free_blocks == 3 and cache.sequences() == []
    with pytest.raises(minidsa.OutOfKVBlocksError):
        minidsa.generate(["abcdefghij", "abcdefghij"], tiny_model, max_new_tokens=4, cache=cache)
    assert cache.num_free_blocks == 3
    out = minidsa.generate("short", tiny_model, max_new_tokens=4, temperature=0, cache=cache, stop_at_eos=False)
    ref = minidsa.generate("short", tiny_model, max_new_tokens=4, temperature=0, stop_at_eos=False)
    assert out == ref and cache.num_free_blocks == 3


def test_abandoned_stream_gives_blocks_back(tiny_model):
    cache = tiny_model.new_cache()
    stream = minidsa.stream("stream", tiny_model, max_new_tokens=30, cache=cache, stop_at_eos=False)
    next(stream)
    assert cache.num_free_blocks < cache.layout.num_blocks
    stream.close()
    assert cache.num_free_blocks == cache.layout.num_blocks


def test_cli_generate(capsys):
    """``python -m minidsa`` in a process of its own (the entry point itself), then a user error in this one
    (the same main(); a second interpreter start would only cost seconds)."""
    from minidsa.cli import main
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "minidsa", "generate", "hello", "--max-new-tokens", "8",
                        "--ignore-eos", "--no-progress"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "8 tokens in" in r.stderr and "tokens/s" in r.stderr
    threads = torch.get_num_threads()
    try:
        assert main(["generate", "hello", "--top-p", "2"]) == 2 and "top_p" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)  # main() sets the CLI's thread count; the test run keeps its own


def test_cli_generate_with_an_image(tmp_path, capsys):
    from PIL import Image

    from minidsa.cli import main
    Image.new("RGB", (60, 40), (200, 10, 10)).save(tmp_path / "red.png")
    assert main(["generate", "what colour?", "--image", str(tmp_path / "red.png"), "--max-new-tokens", "3",
                 "--ignore-eos", "--no-progress"]) == 0
    assert "3 tokens in" in capsys.readouterr().err
    (tmp_path / "bad.png").write_text("nope")
    assert main(["generate", "x", "--image", str(tmp_path / "bad.png"), "--no-progress"]) == 2
    assert "not a readable PNG/JPEG" in capsys.readouterr().err


def test_too_many_sequences_for_the_state_slots(tiny_model):
    cache = tiny_model.new_cache()
    n = tiny_model.config.max_sequences
    with pytest.raises(minidsa.OutOfKVBlocksError, match="state slots"):
        minidsa.generate(["x"] * (n + 1), tiny_model, max_new_tokens=2, cache=cache)
    assert cache.sequences() == [] and cache.num_free_state_slots == n and cache.num_free_blocks == 128
    assert len(minidsa.generate(["x"] * n, tiny_model, max_new_tokens=2, cache=cache)) == n


def test_generate_returns_text_and_stream_streams_it(tiny_model):
    """One return type: a str (a list of str for a batch) whose ``.trace`` is None unless asked for."""
    kw = dict(max_new_tokens=6, temperature=0, stop_at_eos=False)
    text = minidsa.generate("abc", tiny_model, **kw)
    assert type(text) is minidsa.Generation and isinstance(text, str) and text.trace is None
    traced = minidsa.generate("abc", tiny_model, trace=True, **kw)
    assert traced == text and len(traced.trace.token_ids) == traced.trace.prompt_len + 6
    batch = minidsa.generate(["abc", "de"], tiny_model, trace=True, **kw)
    assert isinstance(batch, list) and batch[0] == text and [len(t.trace.token_ids) for t in batch] == [10, 9]
    with minidsa.stream("abc", tiny_model, **kw) as s:
        assert "".join(s) == text
    assert list(minidsa.stream(["abc", "de"], tiny_model, **kw))[0][0] in (0, 1)


def test_the_old_flags_still_work_with_a_warning_naming_the_new_call(tiny_model):
    kw = dict(max_new_tokens=5, temperature=0, stop_at_eos=False)
    want = minidsa.generate("abc", tiny_model, trace=True, **kw)
    with pytest.warns(DeprecationWarning, match=r"minidsa\.stream\(\.\.\.\)"):
        s = minidsa.generate("abc", tiny_model, stream=True, **kw)
    assert "".join(s) == want
    with pytest.warns(DeprecationWarning, match=r"trace=True"):
        text, trace = minidsa.generate("abc", tiny_model, return_trace=True, **kw)
    assert text == want and trace.token_ids == want.trace.token_ids
    with pytest.raises(TypeError, match="'strem'"):
        minidsa.generate("abc", tiny_model, strem=True, **kw)
