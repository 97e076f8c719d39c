"""Prefix caching that is right for a recurrent state (docs/design.md §16).

An MLA layer's KV rows of a prompt prefix depend only on that prefix, so full KV blocks can be shared:
each full block is named by a hash chained over every token before it (images by their pixels), and a
new prompt reuses the blocks whose names it shares. A KDA layer is different: its state after the
prefix is one tensor that absorbed every token, and it cannot be cut back to an earlier length. A KV
hit is therefore only usable where a KDA checkpoint (a copy of every KDA layer's state, taken when a
prefill reached that boundary) exists too: the hit is clamped to the deepest block boundary that has
both, the checkpoint is copied into the new sequence's own state slot (never shared in place, since the
sequence goes on to change it), and the tokens after the boundary are computed again.

Blocks are held by the cache (``PagedKVCache.hold``) while they are named here and evicted least
recently used first once no sequence uses them; checkpoints are kept up to ``max_checkpoints``, least
recently used dropped first. Queries and hits are counted in tokens, KV and KDA apart: the KV count says
how much the blocks alone would give, the KDA count how much the clamp leaves.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from ..cache import PagedKVCache


def block_hashes(token_ids: list[int], media: list[bytes | None], block_size: int) -> list[bytes]:
    """One name per full block of ``token_ids``: hash(previous name, the block's ids, the media it holds).

    ``media[t]`` is None for a text token and, for an image or video token, the digest of its item's
    pixels plus its index within the item, so two prompts with different images never share a block."""
    out, prev = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(torch.tensor(token_ids[start:start + block_size], dtype=torch.int64).numpy().tobytes())
        for m in media[start:start + block_size]:
            h.update(m or b"-")
        prev = h.digest()
        out.append(prev)
    return out


class PrefixCache:
    """Named full blocks and KDA checkpoints of one PagedKVCache, with LRU eviction and hit counters."""

    def __init__(self, cache: PagedKVCache, max_checkpoints: int) -> None:
        self.cache = cache
        self.max_checkpoints = max_checkpoints
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # name -> physical block, oldest use first
        self.checkpoints: OrderedDict[bytes, int] = OrderedDict()  # name of the block it ends -> pool entry
        self.has_state = cache.layout.num_state_layers > 0
        # The checkpoints live in one pool allocated here (the memory budget counts it), so a steady
        # workload's memory does not grow as checkpoints are taken: entry i is a snapshot's worth of views.
        n = max_checkpoints if self.has_state else 0
        with torch.inference_mode(False):
            pool = [{name: torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device) for name, t in layer.items()}
                    for layer in cache.state] if n else []
        self._pool = pool
        self._entries = [[{name: t[i] for name, t in layer.items()} for layer in pool] for i in range(n)]
        self._free = list(range(n))
        self.queries = self.hits = self.kv_hits = self.kda_hits = 0  # tokens

    # ---------------------------------------------------------------- lookup
    def match(self, hashes: list[bytes], prompt_len: int) -> tuple[list[int], list | None, int]:
        """The deepest usable hit for a prompt whose full blocks are named ``hashes``: (blocks, checkpoint,
        KV-matched tokens). At least the prompt's last token is always left to compute (its logits give
        the first new token)."""
        bs = self.cache.block_size
        usable = min(len(hashes), (prompt_len - 1) // bs)
        kv = 0
        while kv < usable and hashes[kv] in self.blocks:
            kv += 1
        depth = kv
        if self.has_state:
            while depth > 0 and hashes[depth - 1] not in self.checkpoints:
                depth -= 1
        self._touch(hashes[:depth])
        checkpoint = None
        if self.has_state and depth:
            self.checkpoints.move_to_end(hashes[depth - 1])
            checkpoint = self._entries[self.checkpoints[hashes[depth - 1]]]
        return [self.blocks[h] for h in hashes[:depth]], checkpoint, kv * bs

    def record(self, prompt_len: int, kv_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's query (only admissions count, not attempts that had to wait)."""
        self.queries += prompt_len
        self.kv_hits += kv_tokens
        self.kda_hits += hit_tokens if self.has_state else 0
        self.hits += hit_tokens

    # ---------------------------------------------------------------- filling
    def insert_blocks(self, sid: int, hashes: list[bytes], num_full: int) -> None:
        """Name the first ``num_full`` blocks of sequence ``sid`` (already written) by ``hashes``."""
        table = self.cache.block_table(sid)
        for h, b in zip(hashes[:num_full], table[:num_full]):
            if h not in self.blocks:
                self.cache.hold(b)
                self.blocks[h] = b
        self._touch(hashes[:num_full])

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a chain used, its root last: eviction then takes a chain's deepest blocks first, so what
        stays is still reachable from the root."""
        for h in reversed(chain):
            self.blocks.move_to_end(h)

    def _entry_for(self, name: bytes) -> int | None:
        """A pool entry for a new checkpoint named ``name`` (the least recently used one makes room if need be),
        or None where none is kept or ``name`` has one already (then marked used)."""
        if not self.has_state or self.max_checkpoints == 0:
            return None
        if name in self.checkpoints:
            self.checkpoints.move_to_end(name)
            return None
        if not self._free:
            self._free.append(self.checkpoints.popitem(last=False)[1])
        entry = self.checkpoints[name] = self._free.pop()
        return entry

    def insert_checkpoint(self, name: bytes, sid: int) -> None:
        """Copy the KDA state of ``sid`` (which has just stored the block named ``name``) as a checkpoint."""
        entry = self._entry_for(name)
        if entry is not None:
            self.cache.snapshot_state(sid, out=self._entries[entry])

    def insert_kept(self, names: list[bytes], kept: list) -> None:
        """Checkpoints from states a step kept inside its pieces (``StepContext.kept``: (cache layer, state name,
        states [M, ...])): ``names[m]`` names the block that state m ends. One copy per layer and state name."""
        owner = {}  # entry -> state: with fewer entries than states, a later state takes an earlier one's entry
        for m, name in enumerate(names):
            entry = self._entry_for(name)
            if entry is not None:
                owner[entry] = m
        if not owner:
            return
        entries, rows = (torch.tensor(x, device=kept[0][2].device) for x in zip(*owner.items()))
        for layer, state_name, states in kept:
            pool = self._pool[layer][state_name]
            pool.index_copy_(0, entries.to(pool.device), states.index_select(0, rows).to(pool.dtype))

    def forget(self, sid: int) -> None:
        """Drop the names of the blocks sequence ``sid`` wrote itself, and the checkpoints ending there: its
        request failed on non-finite values, which its KV rows and KDA state may hold too, and a later
        prompt sharing the prefix must compute it afresh rather than inherit them."""
        written = {b for b in self.cache.block_table(sid) if self.cache.block_owner[b] == sid}
        for h in [h for h, b in self.blocks.items() if b in written]:
            self.cache.release(self.blocks.pop(h))
            entry = self.checkpoints.pop(h, None)
            if entry is not None:
                self._free.append(entry)

    # ---------------------------------------------------------------- eviction
    def num_evictable(self) -> int:
        """Blocks held here that no sequence uses: they become free as soon as they are evicted."""
        refs = self.cache.block_refs
        return sum(1 for b in self.blocks.values() if refs[b] == 1)

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks, least recently used first; returns how many were freed."""
        freed = 0
        refs = self.cache.block_refs
        for h in [h for h, b in self.blocks.items() if refs[b] == 1]:
            if freed >= num_blocks:
                break
            self.cache.release(self.blocks.pop(h))
            entry = self.checkpoints.pop(h, None)  # a checkpoint is useless without the block it ends
            if entry is not None:
                self._free.append(entry)
            freed += 1
        return freed
