"""Paged KV cache for the MLA+DSA layers, KDA state slots, and the per-forward cache context
(docs/design.md §3).

Storage is a pool of fixed-size blocks shared by all sequences. A sequence owns a list of block
ids (its block table); token ``pos`` of sequence ``s`` lives in slot
``block_table[s][pos // block_size] * block_size + pos % block_size``. Each MLA layer stores
separate planes (the latent c_kv, the shared k_pe, the indexer key k_I and, with fp8 numerics,
k_I's scale) so prefill reads whole contiguous blocks and decode gathers a few rows per plane.
Planes are described by a ``CacheLayout`` rather than hard-coded shapes: each layer type states what
it needs (``GatedMLA.cache_planes``, ``KimiDeltaAttention.state_shapes``) and the decoder assembles
the layout. This file only allocates and keeps the books; the ops read and write the planes
(``ops.store_kv``, ``ops.paged_index_scores``, ``ops.sparse_mla_*``).

KDA layers keep no KV: each live sequence owns a state slot holding, per KDA layer, the fp32
recurrent state and the short-conv states, described in the same layout.

Before each cached forward the host turns its bookkeeping into a ``CacheContext`` of device tensors
(positions, slot mapping, block table, context lengths, state slots), so the forward itself never
needs to ask the host anything (docs/design.md §14).

A full block may be listed in several block tables (a shared prompt prefix): ``block_refs`` counts its
holders, and a prefix cache may hold it after its sequences are gone (``hold``/``release``).

Allocation is explicit and all-or-nothing: a request that needs more blocks than are free raises
``OutOfKVBlocksError`` before anything changes, so a failed request never loses state.

The books are guarded by one lock per cache: threads that share a cache (two ``generate`` calls on
one model) each take and give back whole sequences without corrupting the free lists, also where
no global interpreter lock makes each list operation atomic (free-threaded Python). Different
sequences write different blocks and state slots, so the forwards themselves need no lock here.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass, field

import torch

from ..ops import cast, paged_kv_slots
from .layout import CacheLayout, OutOfKVBlocksError


def _locked(method):
    """Run a bookkeeping method under the cache's lock (re-entrant: prepare calls reserve)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


def _check_length(sid: int, length, what: str) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"sequence {sid}: cannot {what} to {length!r} tokens; give an int >= 0")


class PagedKVCache:
    """Block pool + block tables + per-block metadata (owner, valid tokens)."""

    def __init__(self, layout: CacheLayout, device: torch.device | str = "cpu") -> None:
        if layout.block_size < 1 or layout.num_blocks < 1:
            raise ValueError(f"cache needs block_size >= 1 and num_blocks >= 1, got {layout.block_size}, "
                             f"{layout.num_blocks}")
        self.layout = layout
        self.device = torch.device(device)
        with torch.inference_mode(False):  # normal tensors: usable in and out of inference mode
            self._allocate()
        self.block_owner = [-1] * layout.num_blocks  # sequence id that wrote each block, -1 = free
        # Holders of each block: the sequences whose table lists it, plus one for a prefix cache's hold. A
        # full block can be shared (prefix caching); it goes back to the free list when the count is 0.
        self.block_refs = [0] * layout.num_blocks
        self.block_tokens = [0] * layout.num_blocks  # valid tokens in each block
        self._free = list(range(layout.num_blocks - 1, -1, -1))  # stack: pop() hands out low ids first
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next_id = 0
        self._lock = threading.RLock()

    def _allocate(self) -> None:
        layout = self.layout
        # storage[layer][plane] : [num_blocks, block_size, width]. Zero-filled so an unwritten slot is
        # deterministic; correctness never depends on it (unselected rows are never read).
        self.storage: list[dict[str, torch.Tensor]] = [
            {p.name: torch.zeros(layout.num_blocks, layout.block_size, p.width, dtype=p.dtype, device=self.device)
             for p in layout.planes}
            for _ in range(layout.num_layers)
        ]
        # state[layer][name] : [num_state_slots, *shape]
        self.state: list[dict[str, torch.Tensor]] = [
            {name: torch.zeros((layout.num_state_slots,) + shape, dtype=layout.state_dtype, device=self.device)
             for name, shape in layout.states}
            for _ in range(layout.num_state_layers)
        ]
        self._free_state_slots = list(range(layout.num_state_slots - 1, -1, -1))
        self._state_slot: dict[int, int] = {}

    # ---------------------------------------------------------------- sequences
    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @_locked
    def add_sequence(self) -> int:
        """Register a new, empty sequence (with a zeroed KDA state slot) and return its id."""
        if not self._free_state_slots:
            raise OutOfKVBlocksError(
                f"KV cache out of state slots: all {self.layout.num_state_slots} KDA state slots are in use. Free "
                f"finished sequences or use a larger cache (config max_sequences).")
        sid = self._next_id
        self._next_id += 1
        self._tables[sid] = []
        self._lengths[sid] = 0
        slot = self._free_state_slots.pop()
        self._state_slot[sid] = slot
        for layer in self.state:
            for t in layer.values():
                t[slot].zero_()  # a new sequence starts from the zero state
        return sid

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_state_slots)

    def sequences(self) -> list[int]:
        return list(self._tables)

    def seq_len(self, sid: int) -> int:
        """Tokens already stored (committed) for sequence ``sid``."""
        self._check_sid(sid)
        return self._lengths[sid]

    def block_table(self, sid: int) -> list[int]:
        self._check_sid(sid)
        return list(self._tables[sid])

    def blocks_needed(self, sid: int, length: int) -> int:
        """Extra blocks sequence ``sid`` needs to hold ``length`` tokens."""
        need = -(-length // self.block_size)  # ceil: a block is needed as soon as one token lands in it
        return max(0, need - len(self._tables[sid]))

    @_locked
    def reserve(self, lengths: dict[int, int]) -> None:
        """Make every sequence ``sid`` able to hold ``lengths[sid]`` tokens. All-or-nothing."""
        for sid in lengths:
            self._check_sid(sid)
        total = sum(self.blocks_needed(sid, n) for sid, n in lengths.items())
        if total > len(self._free):
            raise OutOfKVBlocksError(
                f"KV cache out of blocks: this request needs {total} more blocks of {self.block_size} tokens but "
                f"only {len(self._free)} of {self.layout.num_blocks} are free. Free finished sequences, shorten "
                f"the request, or use a larger cache (model.new_cache(num_blocks=...) or config kv_num_blocks).")
        for sid, n in lengths.items():
            for _ in range(self.blocks_needed(sid, n)):
                b = self._free.pop()
                self.block_owner[b] = sid
                self.block_tokens[b] = 0
                self.block_refs[b] = 1
                self._tables[sid].append(b)

    @_locked
    def commit(self, sid: int, length: int) -> None:
        """Record that positions [0, length) of ``sid`` now hold valid data."""
        self._check_sid(sid)
        _check_length(sid, length, "commit")
        if length > len(self._tables[sid]) * self.block_size:
            raise ValueError(f"sequence {sid}: cannot commit {length} tokens, only "
                             f"{len(self._tables[sid]) * self.block_size} reserved")
        old, bs, table = self._lengths[sid], self.block_size, self._tables[sid]
        self._lengths[sid] = length
        # Only the blocks between the old end and the new one change: those before are full, those after empty
        # (an engine commits every sequence of every step, so this runs once per token generated).
        for j in range(min(old, length) // bs, min(len(table), -(-max(old, length) // bs))):
            self.block_tokens[table[j]] = min(bs, max(0, length - j * bs))

    @_locked
    def free(self, sid: int) -> None:
        """Give the blocks of ``sid`` back to the pool and forget the sequence."""
        self._check_sid(sid)
        for b in reversed(self._tables.pop(sid)):
            self._unref(b)
        del self._lengths[sid]
        if sid in self._state_slot:
            self._free_state_slots.append(self._state_slot.pop(sid))

    @_locked
    def truncate(self, sid: int, length: int) -> None:
        """Forget tokens from ``length`` on and release whole unused blocks.

        Only for caches without KDA layers: a KDA layer's recurrent and conv states have absorbed every
        token, and no earlier state is kept to roll back to, so continuing after a truncate would give
        wrong logits. With KDA layers, free the sequence and prefill the kept tokens again."""
        self._check_sid(sid)
        _check_length(sid, length, "truncate")
        if length > self._lengths[sid]:
            raise ValueError(f"sequence {sid}: cannot truncate to {length} tokens, it holds {self._lengths[sid]}")
        if length < self._lengths[sid] and self.layout.num_state_layers:
            raise ValueError(f"sequence {sid}: cannot truncate from {self._lengths[sid]} to {length} tokens: its "
                             f"{self.layout.num_state_layers} KDA layers' recurrent states already hold the later "
                             f"tokens and cannot be rolled back; free the sequence and prefill the first {length} "
                             f"tokens again")
        self._lengths[sid] = length
        self.release_blocks(sid, keep=-(-length // self.block_size))
        self.commit(sid, length)

    @_locked
    def release_blocks(self, sid: int, keep: int) -> None:
        """Give back the blocks of ``sid`` past its first ``keep`` (never one holding committed tokens)."""
        self._check_sid(sid)
        keep = max(keep, -(-self._lengths[sid] // self.block_size))
        table = self._tables[sid]
        while len(table) > keep:
            self._unref(table.pop())

    def _unref(self, b: int) -> None:
        self.block_refs[b] -= 1
        if self.block_refs[b] == 0:
            self.block_owner[b] = -1
            self.block_tokens[b] = 0
            self._free.append(b)

    # ---------------------------------------------------------------- sharing (prefix caching)
    @_locked
    def share_blocks(self, sid: int, blocks: list[int]) -> None:
        """Start the empty sequence ``sid`` with the full, already written ``blocks`` (another sequence's
        prefix): its length becomes len(blocks) * block_size. The blocks are shared, never written again:
        a sequence only writes past its length, and these end where its own blocks begin."""
        self._check_sid(sid)
        if self._tables[sid] or self._lengths[sid]:
            raise ValueError(f"sequence {sid} already holds tokens; share blocks only into a new sequence")
        for b in blocks:
            if self.block_refs[b] < 1 or self.block_tokens[b] != self.block_size:
                raise ValueError(f"block {b} is not a full block in use ({self.block_tokens[b]} tokens); only "
                                 f"full blocks can be shared")
        for b in blocks:
            self.block_refs[b] += 1
            self._tables[sid].append(b)
        self._lengths[sid] = len(blocks) * self.block_size

    @_locked
    def hold(self, block: int) -> None:
        """Keep ``block`` after every sequence using it is freed (a prefix cache's reference)."""
        if self.block_refs[block] < 1:
            raise ValueError(f"block {block} is free; only a block in use can be held")
        self.block_refs[block] += 1

    @_locked
    def release(self, block: int) -> None:
        """Drop a hold taken with ``hold``; the block is free again once no sequence uses it."""
        self._unref(block)

    # ---------------------------------------------------------------- KDA state copies
    def snapshot_state(self, sid: int, out: list[dict[str, torch.Tensor]] | None = None) -> list[dict[str, torch.Tensor]]:
        """A copy of every KDA layer's state of ``sid`` (per layer, {name: [*shape]}); into ``out`` (the
        same structure, e.g. a preallocated pool's views) when given, so taking it allocates nothing."""
        self._check_sid(sid)
        slot = self._state_slot[sid]
        if out is None:
            return [{name: t[slot].clone() for name, t in layer.items()} for layer in self.state]
        for layer, saved in zip(self.state, out):
            for name, t in layer.items():
                saved[name].copy_(t[slot])
        return out

    def restore_state(self, sid: int, snapshot: list[dict[str, torch.Tensor]]) -> None:
        """Copy ``snapshot`` (from ``snapshot_state``) into the state slot of ``sid``: never shared in place."""
        self._check_sid(sid)
        slot = self._state_slot[sid]
        for layer, saved in zip(self.state, snapshot):
            for name, t in layer.items():
                t[slot].copy_(saved[name])

    def _check_sid(self, sid: int) -> None:
        if isinstance(sid, bool) or not isinstance(sid, int):
            raise TypeError(f"sequence id must be an int (from add_sequence), got {type(sid).__name__} {sid!r}")
        if sid not in self._tables:
            raise ValueError(f"unknown sequence id {sid!r}; live sequences: {sorted(self._tables)} (add_sequence() makes one)")

    # ---------------------------------------------------------------- addressing
    def kv_slots(self, sid: int, positions: torch.Tensor) -> torch.Tensor:
        """Physical KV slots of logical ``positions`` (any shape, int) of sequence ``sid``; -1 stays -1.

        Raises if a position lies outside the reserved blocks (an off-by-one here would otherwise
        write into another sequence's block).
        """
        self._check_sid(sid)
        table = torch.tensor(self._tables[sid] or [0], dtype=torch.long, device=positions.device)
        pos = positions.long()
        valid = pos >= 0
        limit = len(self._tables[sid]) * self.block_size
        if bool((pos[valid] >= limit).any()):
            raise ValueError(f"sequence {sid}: position {int(pos.max())} is past its {limit} reserved slots; "
                             f"call reserve() first")
        safe = torch.where(valid, pos, torch.zeros_like(pos))
        slot = table[safe // self.block_size] * self.block_size + safe % self.block_size
        return torch.where(valid, slot, torch.full_like(slot, -1))

    def block_table_tensor(self, sids: list[int], device: torch.device | str | None = None) -> torch.Tensor:
        """int32 [B, max_blocks], -1 past each sequence's last block (the form a kernel reads); on the
        cache's device unless ``device`` is given."""
        tables = [self._tables[s] for s in sids]
        n = max(map(len, tables), default=0)
        # One tensor from padded lists: one tensor per row would be one allocation per sequence of a step.
        out = torch.tensor([t + [-1] * (n - len(t)) for t in tables], dtype=torch.int32).view(len(sids), n)
        return out.to(self.device if device is None else device)

    # ---------------------------------------------------------------- data
    def plane(self, layer: int, name: str) -> torch.Tensor:
        """Plane ``name`` of MLA cache layer ``layer``: [num_blocks, block_size, width] (ops read and write it)."""
        return self.storage[layer][name]

    def state_slots(self, sids: list[int]) -> torch.Tensor:
        """int64 [B] (host memory): the KDA state slot of each sequence."""
        for sid in sids:
            self._check_sid(sid)
        return torch.tensor([self._state_slot[s] for s in sids], dtype=torch.long)

    def read_state(self, layer: int, name: str, state_slots: torch.Tensor) -> torch.Tensor:
        """State ``name`` of KDA cache layer ``layer`` at ``state_slots`` [B] -> [B, *shape] (a copy)."""
        return self.state[layer][name][state_slots]

    def write_state(self, layer: int, name: str, state_slots: torch.Tensor, value: torch.Tensor) -> None:
        self.state[layer][name][state_slots] = cast(value, self.layout.state_dtype)

    # ---------------------------------------------------------------- one forward
    @_locked
    def reserve_more(self, seq_ids: list[int], num_tokens: list[int],
                     max_len: int | None = None) -> tuple[list[int], dict[int, int]]:
        """Room for ``num_tokens[i]`` more tokens of each sequence ``seq_ids[i]`` (all-or-nothing, none past
        ``max_len``) -> (each sequence's length before, its block count before: what a rollback keeps)."""
        starts = [self.seq_len(s) for s in seq_ids]
        for sid, start, n in zip(seq_ids, starts, num_tokens):
            if max_len is not None and start + n > max_len:
                raise ValueError(f"sequence {sid} would hold {start + n} tokens, more than max_seq_len = {max_len}")
        tables_before = {sid: len(self._tables[sid]) for sid in seq_ids}
        self.reserve({sid: s + n for sid, s, n in zip(seq_ids, starts, num_tokens)})
        return starts, tables_before

    @_locked
    def give_back(self, tables_before: dict[int, int]) -> None:
        """Undo ``reserve_more``: each sequence keeps its first ``tables_before[sid]`` blocks (sequences
        freed meanwhile are skipped). The last reserved go back first, so the free list is as it was and the
        next reservation takes the same blocks."""
        for sid, n in reversed(list(tables_before.items())):
            if sid in self._tables:
                self.release_blocks(sid, keep=n)

    @_locked
    def prepare(self, seq_ids: list[int], num_tokens: int, device: torch.device | str,
                max_len: int | None = None, rows: int | None = None) -> "CacheContext":
        """Reserve room for ``num_tokens`` more tokens in each sequence (all-or-nothing; no sequence may
        exceed ``max_len``; ``rows``: the batch rows seq_ids must match) and describe where they go as
        device tensors. Nothing is committed until ``CacheContext.publish``."""
        if seq_ids is None:
            raise ValueError(f"pass seq_ids with one cache sequence per batch row ({rows}) along with cache=")
        if not isinstance(seq_ids, (list, tuple)):
            raise TypeError(f"seq_ids must be a list of cache sequence ids, one per batch row (e.g. [sid] for one "
                            f"row), got {type(seq_ids).__name__} {seq_ids!r}")
        if rows is not None and len(seq_ids) != rows:
            raise ValueError(f"pass seq_ids with one cache sequence per batch row ({rows}), got {seq_ids!r}")
        seq_ids = list(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be distinct, got {seq_ids!r}")
        starts, tables_before = self.reserve_more(seq_ids, [num_tokens] * len(seq_ids), max_len)
        positions = torch.tensor(starts).unsqueeze(1) + torch.arange(num_tokens)  # [B, T], host
        table = self.block_table_tensor(seq_ids, device="cpu")
        kv_slots = paged_kv_slots(table, positions, self.block_size)
        lens = torch.tensor([s + num_tokens for s in starts])
        # One upload for all metadata (a host-to-device copy per tensor would be one wait each).
        packed = torch.cat([positions.reshape(-1), kv_slots.reshape(-1), table.reshape(-1).long(), lens,
                            self.state_slots(seq_ids)]).to(device)
        B, T = positions.shape
        sizes = [B * T, B * T, table.numel(), B, B]
        pos, kv_slots, tab, context_lens, state_slots = packed.split(sizes)
        return CacheContext(self, list(seq_ids), starts, pos.view(B, T), kv_slots, tab.view(table.shape).int(),
                            context_lens.int(), state_slots, tables_before)

def check_cache_layout(cache, layout_for) -> None:
    """TypeError unless ``cache`` is a PagedKVCache; ValueError unless its layout is
    ``layout_for(num_blocks)``, the layout the model would make (checked before anything is taken). The
    block and state slot counts are capacities, not layout: any count fits the model."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache (model.new_cache()), got {type(cache).__name__}")
    expected = layout_for(cache.layout.num_blocks)
    if dataclasses.replace(cache.layout, num_state_slots=expected.num_state_slots) != expected:
        raise ValueError("this cache was made for a different model layout; use model.new_cache()")


@dataclass
class CacheContext:
    """Where the tokens of one cached forward go and what they may read. B sequences, T new tokens each.

    Built on the host by ``PagedKVCache.prepare`` before the forward; layers only read it (and stage
    their new KDA states in it), so the forward needs no host round trip.
    """

    cache: PagedKVCache
    seq_ids: list[int]  # cache sequence of each batch row
    starts: list[int]  # tokens each sequence held before this forward (host copy)
    positions: torch.Tensor  # int64 [B, T] absolute positions of the new tokens
    kv_slots: torch.Tensor  # int64 [B * T] physical slot of each new token, row-major
    block_table: torch.Tensor  # int32 [B, max_blocks] physical block of each logical block, -1 past the end
    context_lens: torch.Tensor  # int32 [B] tokens each sequence holds once this forward's are stored
    state_slots: torch.Tensor  # int64 [B] KDA state slot of each sequence
    tables_before: dict = field(default_factory=dict)  # blocks each sequence owned before this forward
    staged: dict = field(default_factory=dict)  # (cache layer, state name) -> new KDA state [B, ...]

    def stage_state(self, layer: int, name: str, value: torch.Tensor) -> None:
        """Keep a KDA layer's new state until the whole forward succeeds."""
        self.staged[(layer, name)] = value

    def rollback(self) -> None:
        """The forward failed: give back the blocks it reserved (sequences freed meanwhile are skipped)."""
        self.cache.give_back(self.tables_before)

    def publish(self) -> None:
        """The forward succeeded: write the staged KDA states and commit the new lengths."""
        for (layer, name), value in self.staged.items():
            self.cache.write_state(layer, name, self.state_slots, value)
        T = self.positions.shape[1]
        for sid, start in zip(self.seq_ids, self.starts):
            self.cache.commit(sid, start + T)
