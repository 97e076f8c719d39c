"""Continuous batching: which requests run in the next step, and how many of their tokens (docs/design.md §16).

Every step has a token budget (``max_num_batched_tokens``). Running requests go first, oldest first: a
decoding one takes one token, a prefilling one its next chunk. Waiting requests are then admitted in
arrival order while the budget, ``max_num_seqs``, a free KDA state slot and free KV blocks allow; an
admitted request starts from its prefix-cache hit. Prefill chunks end on multiples of ``align`` tokens
(a KV block and a KDA chunk both end there), except the last one of a prompt.

A step's blocks are reserved while it is scheduled, so the forward cannot run out. When a running
request cannot get its blocks, the newest running request is preempted (recompute: its blocks and
state slot are given back and it waits at the front of the queue to prefill its prompt and output so far
again), and counted.

Decoding and prefilling are the same thing here: a request has ``num_tokens`` (prompt + output) and
``num_computed`` of them in the cache; a step computes some of the rest, and when it reaches the end the
step's last logits give the next token. So the token sampled at the end of a prefill is fed exactly
once, by the next step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache import PagedKVCache
from . import sharing
from .params import RequestMetrics, SamplingParams
from .prefix_cache import PrefixCache


@dataclass
class EngineRequest:
    """One request inside the engine: its ids, its place in the cache, its sampler and its output so far."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    features: list[torch.Tensor]  # media features in placeholder order ([num_tokens, d] each)
    hashes: list[bytes]  # names of the prompt's full KV blocks (prefix_cache.block_hashes)
    params: SamplingParams
    generator: torch.Generator
    decoder: object  # the tokenizer's incremental UTF-8 decoder
    metrics: RequestMetrics
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    sid: int | None = None  # cache sequence while running
    num_computed: int = 0  # tokens of prompt + output stored in the cache
    finish_reason: str | None = None
    error: str | None = None
    embeds: torch.Tensor | None = None  # prompt embeddings [T, d] with media filled (made on first use)
    trace: object = None  # a GenerationTrace to fill (generate(trace=True))
    pending_finish: str | None = None  # finished, its last token still to be fed for the trace

    def tokens(self, start: int, end: int) -> list[int]:
        """Ids [start, end) of prompt + output, without building the whole list (a decode step reads one)."""
        P = len(self.prompt_ids)
        if start >= P:
            return self.output_ids[start - P: end - P]
        return self.prompt_ids[start:end] + self.output_ids[: max(0, end - P)]

    def has_media_from(self, start: int) -> bool:
        """Whether ids from ``start`` on include prompt positions of a request with images."""
        return bool(self.features) and start < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    """The waiting queue and the running list of one engine, over its cache and prefix cache."""

    def __init__(self, cache: PagedKVCache, prefix: PrefixCache | None, max_num_seqs: int,
                 max_num_batched_tokens: int, chunked: bool, align: int) -> None:
        self.cache, self.prefix = cache, prefix
        self.max_num_seqs, self.budget, self.chunked, self.align = max_num_seqs, max_num_batched_tokens, chunked, align
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0

    def schedule(self) -> list[tuple[EngineRequest, int]]:
        """The next step: (request, tokens to compute) pairs, their blocks reserved."""
        budget, out, preempted = self.budget, [], False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new(req, budget)
            if n:
                before = self.num_preemptions
                if not self._grow(req, n):
                    preempted = True
                    break
                preempted |= self.num_preemptions > before
                out.append((req, n))
                budget -= n
            i += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            admitted = self._admit(self.waiting[0], budget)
            if not admitted:
                break
            out.append(admitted)
            budget -= admitted[1]
        return out

    def _num_new(self, req: EngineRequest, budget: int) -> int:
        """Tokens of ``req`` this step may compute within ``budget`` (0: wait for the next step)."""
        remaining = req.num_tokens - req.num_computed
        if remaining <= budget:
            return remaining
        if not self.chunked:
            return 0
        end = req.num_computed + budget
        end -= end % self.align  # a chunk that is not the last ends on a block and KDA chunk boundary
        return max(0, end - req.num_computed)

    def _grow(self, req: EngineRequest, n: int) -> bool:
        """Reserve blocks for ``n`` more tokens of running ``req``, evicting cached blocks, then preempting
        the newest running requests; False if ``req`` itself had to go."""
        while not self._reserve(req.sid, req.num_computed + n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def _reserve(self, sid: int, length: int) -> bool:
        need = self.cache.blocks_needed(sid, length)
        if need == 0:  # most decode steps: the last block has room
            return True
        short = need - self.cache.num_free_blocks
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        if need > self.cache.num_free_blocks:
            return False
        self.cache.reserve({sid: length})
        return True

    def _admit(self, req: EngineRequest, budget: int) -> tuple[EngineRequest, int] | None:
        """Start the first waiting request from its prefix hit if a state slot and its blocks are free."""
        if self.cache.num_free_state_slots == 0:
            return None
        blocks, checkpoint, kv_tokens = [], None, 0
        if self.prefix is not None:
            blocks, checkpoint, kv_tokens = self.prefix.match(req.hashes, len(req.prompt_ids))
        sid = self.cache.add_sequence()
        if blocks:
            self.cache.share_blocks(sid, blocks)  # shared before any eviction, so they cannot be evicted
            if checkpoint is not None:
                self.cache.restore_state(sid, checkpoint)
        req.sid, req.num_computed = sid, len(blocks) * self.cache.block_size
        n = self._num_new(req, budget)
        if n == 0 or not self._reserve(sid, req.num_computed + n):
            self.cache.free(sid)
            req.sid, req.num_computed = None, 0
            return None
        req.metrics.num_cached_tokens = req.num_computed
        if self.prefix is not None:
            self.prefix.record(len(req.prompt_ids), kv_tokens, req.num_computed)
        self.waiting.popleft()
        self.running.append(req)
        return req, n

    def admit_all(self, reqs: list[EngineRequest], lengths: list[int]) -> None:
        """Start every waiting request in ``reqs``, with room for ``lengths`` tokens each reserved: all or
        nothing, after the calls ahead on a shared cache and, where other threads' calls hold the room,
        once they give it back (sharing.py); OutOfKVBlocksError naming the shortage, nothing kept, where
        waiting cannot help. ``generate()``'s batch."""
        sids = sharing.take(self.cache, lengths)
        for req, sid in zip(reqs, sids):
            req.sid, req.num_computed = sid, 0
            self.waiting.remove(req)
            self.running.append(req)

    def preempt(self, req: EngineRequest) -> None:
        """Give back what ``req`` holds; it waits first in line to compute its prompt and output again."""
        self.running.remove(req)
        self.cache.free(req.sid)
        sharing.given_back(self.cache, req.sid)
        req.sid, req.num_computed = None, 0
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def remove(self, req: EngineRequest) -> None:
        """Forget a finished or aborted request and free its sequence."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.sid is not None:
            self.cache.free(req.sid)
            sharing.given_back(self.cache, req.sid)
            req.sid = None
