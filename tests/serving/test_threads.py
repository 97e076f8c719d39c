"""Several threads on one model give, call for call, exactly what the same calls give one after another:
the shared FP8 expert workspace is held from each MoE layer's conversion to its last read, the cache's
books are locked, and the process-wide default model is built once (README, "Threads")."""

import random
import sys
import threading
import time

import pytest
import torch

import minidsa
from minidsa.serving import sharing
from minidsa.training import tasks

PROMPTS = [s.prompt for s in tasks.samples("retrieval", "eval", 3, 0, 8, 72)]


def run_in_threads(fn, jobs: list, threads: int = 2) -> list:
    """fn(job) for every job, spread over ``threads`` threads that switch as often as Python allows."""
    results, errors = [None] * len(jobs), []

    def worker(k):
        try:
            for i in range(k, len(jobs), threads):
                results[i] = fn(jobs[i])
        except Exception as e:  # noqa: BLE001 -- re-raised in the main thread below
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def model():
    return minidsa.load("default", progress=False)


def test_two_threads_on_one_model_give_the_sequential_logits_bit_for_bit(model):
    ids = [torch.tensor([model.tokenizer.encode(p)]) for p in PROMPTS] * 4   # 32 calls
    with torch.no_grad():
        alone = [model(x) for x in ids]
        together = run_in_threads(lambda x: model(x), list(ids))
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_two_threads_generating_with_traces_equal_the_calls_alone(model):
    def call(prompt):
        text = minidsa.generate(prompt, model, max_new_tokens=6, temperature=0, trace=True)
        trace = text.trace
        return text, {k: v.clone() for k, v in trace.selected.items()}

    jobs = PROMPTS[:6]
    alone = [call(p) for p in jobs]
    together = run_in_threads(call, jobs)
    for (text_a, sel_a), (text_b, sel_b) in zip(alone, together):
        assert text_a == text_b and sel_a.keys() == sel_b.keys()
        assert all(torch.equal(sel_a[k], sel_b[k]) for k in sel_a)
    assert model.default_cache().num_free_blocks == model.default_cache().layout.num_blocks   # all given back


def pass_key_prompt(seed: int) -> str:
    """The README's pass-key prompt (174 tokens) with its own name and key."""
    rng = random.Random(seed)
    name, key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3)), rng.randrange(10000, 100000)
    return (f"the river runs past old town where people walk slowly The pass key of {name} is {key}. birds sing of "
            f"morning light on hills far away and the sky is blue\nQ: pass key of {name}?\nA: ")


@pytest.mark.slow  # 16 threads of 16 tokens on one core: about 10 s
def test_sixteen_threads_with_readme_sized_prompts_each_get_their_answer_alone(model, monkeypatch):
    """Each call takes 24 of the default cache's 128 blocks, so at most five fit at once: the others wait
    for the blocks the finished calls give back (the sixth used to fail with OutOfKVBlocksError)."""
    cache = model.default_cache()
    prompts = [pass_key_prompt(i) for i in range(16)]
    assert {len(model.tokenizer.encode(p)) for p in prompts} == {174}

    def call(prompt):
        return minidsa.generate(prompt, model, max_new_tokens=16, temperature=0, stop_at_eos=False)

    alone = [call(p) for p in prompts]
    full, take_now = [], sharing._take_now

    def counting(cache, lengths):
        try:
            return take_now(cache, lengths)
        except minidsa.OutOfKVBlocksError:
            full.append(1)
            raise
    monkeypatch.setattr(sharing, "_take_now", counting)
    together = run_in_threads(call, prompts, threads=16)
    assert together == alone
    assert full, "no call found the cache full: the test did not exercise the wait"
    assert cache.num_free_blocks == cache.layout.num_blocks and cache.sequences() == []


README = pass_key_prompt(0)


def test_a_call_fails_at_once_when_only_its_own_thread_holds_the_room(model):
    """Nothing another thread holds would come back: waiting would only hang (here, on this thread's stream)."""
    cache = model.new_cache(num_blocks=30)  # one 24-block call at a time
    with minidsa.stream(README, model, max_new_tokens=16, cache=cache) as stream:
        next(stream)
        t0 = time.monotonic()
        with pytest.raises(minidsa.OutOfKVBlocksError, match="out of blocks.*Free finished sequences"):
            minidsa.generate(README, model, max_new_tokens=16, cache=cache)
        assert time.monotonic() - t0 < 5
    assert cache.num_free_blocks == 30 and cache.sequences() == []


def test_a_call_gives_up_waiting_when_nothing_comes_back(model, monkeypatch):
    """Behind a stream another thread opened and left open, a call waits WAIT_S, then says what holds it."""
    monkeypatch.setattr(sharing, "WAIT_S", 0.5)
    cache = model.new_cache(num_blocks=30)
    opened, done = threading.Event(), threading.Event()

    def holder():
        with minidsa.stream(README, model, max_new_tokens=16, cache=cache) as stream:
            next(stream)
            opened.set()
            done.wait(30)
    t = threading.Thread(target=holder)
    t.start()
    try:
        assert opened.wait(30)
        with pytest.raises(minidsa.OutOfKVBlocksError, match="waited 0.5 s for 24 blocks.*another thread's call holds"):
            minidsa.generate(README, model, max_new_tokens=16, cache=cache)
    finally:
        done.set()
        t.join()
    assert cache.num_free_blocks == 30
    text = minidsa.generate(README, model, max_new_tokens=16, cache=cache, temperature=0, stop_at_eos=False)
    assert text == minidsa.generate(README, model, max_new_tokens=16, temperature=0, stop_at_eos=False)
