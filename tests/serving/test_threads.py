"""Several threads on one model give, call for call, exactly what the same calls give one after another:
the shared FP8 expert workspace is held from each MoE layer's conversion to its last read, the cache's
books are locked, and the process-wide default model is built once (README, "Threads")."""

import sys
import threading

import pytest
import torch

import minidsa
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
        text, trace = minidsa.generate(prompt, model, max_new_tokens=6, temperature=0, return_trace=True)
        return text, {k: v.clone() for k, v in trace.selected.items()}

    jobs = PROMPTS[:6]
    alone = [call(p) for p in jobs]
    together = run_in_threads(call, jobs)
    for (text_a, sel_a), (text_b, sel_b) in zip(alone, together):
        assert text_a == text_b and sel_a.keys() == sel_b.keys()
        assert all(torch.equal(sel_a[k], sel_b[k]) for k in sel_a)
    assert model.default_cache().num_free_blocks == model.default_cache().layout.num_blocks   # all given back
