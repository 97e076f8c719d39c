"""A request gives back every cache sequence and block however it ends: a stream broken out of, closed, left
through ``with``, or whose consumer raises; a failed direct forward; a cache of another layout is refused
before anything is taken from it. No garbage collector run is needed (it is switched off here)."""

import gc

import pytest
import torch

import minidsa
from minidsa.cache import PagedKVCache


@pytest.fixture(scope="module")
def model():
    return minidsa.load("default", progress=False)


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def untouched(cache) -> bool:
    return cache.num_free_blocks == cache.layout.num_blocks and cache.num_free_state_slots == \
        cache.layout.num_state_slots and not cache.sequences()


def test_breaking_out_of_a_stream_frees_at_once(model, no_gc):
    cache = model.new_cache()
    for _ in range(3):   # 16 rows take every state slot: a leak would fail the second round
        for _piece in minidsa.stream(["hello"] * 16, model, max_new_tokens=8, cache=cache):
            break
        assert untouched(cache)


def test_an_exception_in_the_consumer_frees_at_once(model, no_gc):
    cache = model.new_cache()
    with pytest.raises(RuntimeError, match="consumer"):
        for _piece in minidsa.stream("hello", model, max_new_tokens=8, cache=cache):
            raise RuntimeError("consumer failed")
    assert untouched(cache)


def test_with_and_close_free_a_stream_kept_in_a_variable(model, no_gc):
    cache = model.new_cache()
    with minidsa.stream("hello", model, max_new_tokens=8, cache=cache) as s:
        next(s)
        assert not untouched(cache)
    assert untouched(cache)
    s = minidsa.stream("hello", model, max_new_tokens=8, cache=cache)
    next(s)
    s.close()
    assert untouched(cache)


def test_a_failed_direct_forward_gives_back_what_it_reserved(model, monkeypatch):
    cache = model.new_cache()
    sid = cache.add_sequence()
    ids = torch.tensor([model.tokenizer.encode("hello there")])
    model(ids, cache=cache, seq_ids=[sid])
    blocks, length = cache.block_table(sid), cache.seq_len(sid)
    def fail(*args, **kwargs):
        raise RuntimeError("layer failed")

    monkeypatch.setattr(model.language_model.lm_head, "forward", fail)   # after every layer ran
    with pytest.raises(RuntimeError, match="layer failed"):
        model(torch.tensor([[5] * 20]), cache=cache, seq_ids=[sid])   # would need 3 more blocks
    assert cache.block_table(sid) == blocks and cache.seq_len(sid) == length


def test_another_layout_or_bad_seq_ids_are_refused_before_anything_is_taken(model):
    other = minidsa.MiniDSA("laptop", device="meta").cache_layout(4)
    foreign = PagedKVCache(other)
    for call in (minidsa.generate, minidsa.stream):
        with pytest.raises(ValueError, match="different model layout"):
            call("hello", model, cache=foreign)
        assert untouched(foreign)
    cache = model.new_cache()
    sid = cache.add_sequence()
    with pytest.raises(TypeError, match=r"list of cache sequence ids.*got int 0"):
        model(torch.tensor([[5, 6]]), cache=cache, seq_ids=0)
    with pytest.raises(TypeError, match="sequence id must be an int"):
        model(torch.tensor([[5, 6]]), cache=cache, seq_ids=["0"])
    with pytest.raises(ValueError, match=f"unknown sequence id {sid + 7}"):
        model(torch.tensor([[5, 6]]), cache=cache, seq_ids=[sid + 7])
    assert cache.seq_len(sid) == 0 and cache.block_table(sid) == []
