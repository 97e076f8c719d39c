"""generate() calls that share one cache (the model's default cache, used by several Python threads).

A generate() call reserves its whole length up front, all or nothing. When the cache cannot hold it now
but could hold it empty, the call waits for the blocks and state slots that other threads' calls will
give back when they end, rather than failing: the calls take their turns in arrival order (so a large
call is not passed over forever by small ones), and each computes exactly what it would alone. A call
fails at once instead when waiting cannot help: it could never fit, or no other thread's call holds
anything (what is taken belongs to this thread's own open streams, or to engines and sequences outside
generate()). It also fails after ``WAIT_S`` seconds in which nothing was given back, e.g. behind a
stream that another thread opened and never finished or closed.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

from ..cache import OutOfKVBlocksError, PagedKVCache

# The longest a call waits while nothing is given back. Every call gives its blocks back when it ends, so
# this runs out only behind a call that alone takes longer, or behind a stream another thread left open:
# that shows as an error naming the cause rather than as a hang.
WAIT_S = 300.0


class _Turns:
    """One cache's queue of waiting calls and the sequences generate() calls hold, by thread."""

    def __init__(self) -> None:
        self.changed = threading.Condition()  # notified when the queue moves or a sequence is given back
        self.queue: deque[object] = deque()
        self.owner: dict[int, int] = {}  # cache sequence -> thread ident of the call holding it
        self.returned = 0  # sequences given back so far: a waiter's clock restarts only when this moves


_TURNS: weakref.WeakKeyDictionary[PagedKVCache, _Turns] = weakref.WeakKeyDictionary()
_TURNS_LOCK = threading.Lock()


def _turns(cache: PagedKVCache) -> _Turns:
    with _TURNS_LOCK:
        return _TURNS.setdefault(cache, _Turns())


def take(cache: PagedKVCache, lengths: list[int]) -> list[int]:
    """New cache sequences, one per entry of ``lengths``, each with room for that many tokens reserved;
    waits its turn and for room as the module docstring says. OutOfKVBlocksError, nothing taken, when
    it cannot be admitted."""
    _check_ever_fits(cache, lengths)
    turns, me = _turns(cache), threading.get_ident()
    ticket = object()
    with turns.changed:
        turns.queue.append(ticket)
        try:
            deadline = time.monotonic() + WAIT_S
            while True:
                if turns.queue[0] is ticket:
                    try:
                        sids = _take_now(cache, lengths)
                        turns.owner.update(dict.fromkeys(sids, me))
                        return sids
                    except OutOfKVBlocksError:
                        if all(owner == me for owner in turns.owner.values()):
                            raise  # nothing another thread's call holds could come back
                left, returned = deadline - time.monotonic(), turns.returned
                if left <= 0:
                    raise OutOfKVBlocksError(_waited_message(cache, lengths))
                turns.changed.wait(left)
                if turns.returned != returned:
                    deadline = time.monotonic() + WAIT_S
        finally:
            turns.queue.remove(ticket)
            turns.changed.notify_all()  # the next in line may now try


def given_back(cache: PagedKVCache, sid: int) -> None:
    """Sequence ``sid`` of ``cache`` was freed: wake the calls waiting for room."""
    turns = _TURNS.get(cache)
    if turns is None:  # no generate() call has used this cache
        return
    with turns.changed:
        turns.owner.pop(sid, None)
        turns.returned += 1
        turns.changed.notify_all()


def _take_now(cache: PagedKVCache, lengths: list[int]) -> list[int]:
    """All the sequences and their blocks now, or OutOfKVBlocksError with nothing kept."""
    sids: list[int] = []
    try:
        for _ in lengths:
            sids.append(cache.add_sequence())
        cache.reserve(dict(zip(sids, lengths)))
    except BaseException:
        for sid in sids:
            cache.free(sid)
        raise
    return sids


def _blocks(cache: PagedKVCache, lengths: list[int]) -> int:
    return sum(-(-n // cache.block_size) for n in lengths)


def _check_ever_fits(cache: PagedKVCache, lengths: list[int]) -> None:
    """OutOfKVBlocksError when even the empty cache could not hold the call: waiting would not help."""
    lay = cache.layout
    if len(lengths) > lay.num_state_slots:
        raise OutOfKVBlocksError(
            f"KV cache out of state slots: this request has {len(lengths)} sequences but the cache has "
            f"{lay.num_state_slots} KDA state slots in all; split the batch or use a larger cache (config "
            f"max_sequences)")
    need = _blocks(cache, lengths)
    if need > lay.num_blocks:
        raise OutOfKVBlocksError(
            f"KV cache out of blocks: this request needs {need} blocks of {cache.block_size} tokens but the cache "
            f"has {lay.num_blocks} in all; shorten the request (fewer prompts, shorter ones or a lower "
            f"max_new_tokens) or use a larger cache (model.new_cache(num_blocks=...) or config kv_num_blocks)")


def _waited_message(cache: PagedKVCache, lengths: list[int]) -> str:
    lay = cache.layout
    return (f"KV cache out of blocks: this request waited {WAIT_S:g} s for {_blocks(cache, lengths)} blocks and "
            f"{len(lengths)} state slots ({cache.num_free_blocks} of {lay.num_blocks} blocks and "
            f"{cache.num_free_state_slots} of {lay.num_state_slots} slots free) while no other call gave any "
            f"back; another thread's call holds them (a stream keeps its blocks until it is exhausted or "
            f"closed): finish or close it, or give this call a cache of its own (cache=model.new_cache())")
