"""The metadata of one packed engine step: every scheduled piece on one token axis (docs/design.md §16).

An engine step runs its pieces (a request's next tokens: one for a decode, a chunk for a prefill) as a
single forward over ``N = sum(num_tokens)`` tokens, ``[1, N, d]``. The rows of one token come first: they
are the decode rows, and every attention-like op runs them together through its decode form, as a
``[num_decode, 1]`` batch. Each longer piece then runs the prefill form of those ops over its own
tokens. Everything else (projections, norms, residual mixers, the MoE) sees N tokens and knows nothing
of pieces.

    token axis   | d0 d1 d2 | p0 p0 p0 p0 p0 | p1 p1 p1 |       num_decode = 3, pieces = 5
    query_start    0  1  2  3               8          11      (cumulative, host list and device tensor)

The host builds it once per step, before the forward (``prepare_step``), so no layer asks the host
anything: positions, slot mapping, block tables, context lengths and state slots are device tensors,
and every slice a layer takes is at offsets known on the host. Each layer reads its parts through
``decode_part()`` and ``piece(i)``, which are ordinary ``CacheContext``s over views of these tensors:
the decode and prefill code of the rectangle forward (``model(ids, cache=...)``, the reference) runs
unchanged on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops import paged_slots
from .paged import CacheContext, PagedKVCache


@dataclass
class StepContext:
    """Where the N tokens of one packed forward go and what they may read. P pieces, decode rows first."""

    cache: PagedKVCache
    seq_ids: list[int]  # cache sequence of each piece
    starts: list[int]  # tokens each sequence held before this step (its computed length, host)
    query_start: list[int]  # [P + 1] host: piece i is tokens query_start[i] .. query_start[i + 1]
    num_decode: int  # pieces of one token, placed first: they run the decode forms together
    positions: torch.Tensor  # int64 [N] absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # int64 [N] physical KV slot of each token
    block_table: torch.Tensor  # int32 [P, max_blocks], -1 past each sequence's last block
    context_lens: torch.Tensor  # int32 [P] tokens each sequence holds once the step's are stored
    state_slots: torch.Tensor  # int64 [P] KDA state slot of each piece's sequence
    query_start_loc: torch.Tensor  # int32 [P + 1] query_start on the device (for varlen kernels)
    tables_before: dict = field(default_factory=dict)  # blocks each sequence owned before this step
    staged: list = field(default_factory=list)  # (cache layer, state name, state slots, new state)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @property
    def num_pieces(self) -> int:
        return len(self.seq_ids)

    def prefill_pieces(self) -> range:
        """Indices of the pieces of more than one token (after the decode rows)."""
        return range(self.num_decode, self.num_pieces)

    def span(self, i: int) -> tuple[int, int]:
        """Token range [a, b) of piece ``i``."""
        return self.query_start[i], self.query_start[i + 1]

    def decode_part(self) -> CacheContext:
        """The decode rows as a [num_decode, 1] context (the rectangle decode's)."""
        n = self.num_decode
        return _Part(self.cache, self.seq_ids[:n], self.starts[:n], self.positions[:n].view(n, 1),
                     self.slot_mapping[:n], self.block_table[:n], self.context_lens[:n], self.state_slots[:n],
                     parent=self)

    def piece(self, i: int) -> CacheContext:
        """Piece ``i`` as a [1, T_i] context (the rectangle prefill's, for one sequence)."""
        a, b = self.span(i)
        return _Part(self.cache, self.seq_ids[i:i + 1], self.starts[i:i + 1], self.positions[a:b].view(1, b - a),
                     self.slot_mapping[a:b], self.block_table[i:i + 1], self.context_lens[i:i + 1],
                     self.state_slots[i:i + 1], parent=self)

    def rollback(self) -> None:
        """The forward failed: give back the blocks this step reserved (sequences freed meanwhile are skipped)."""
        for sid, n in self.tables_before.items():
            if sid in self.cache.sequences():
                self.cache.release_blocks(sid, keep=n)

    def publish(self) -> None:
        """The forward succeeded: write the staged KDA states and commit the new lengths."""
        for layer, name, slots, value in self.staged:
            self.cache.write_state(layer, name, slots, value)
        for i, (sid, start) in enumerate(zip(self.seq_ids, self.starts)):
            a, b = self.span(i)
            self.cache.commit(sid, start + b - a)


@dataclass
class _Part(CacheContext):
    """A view of some pieces of a StepContext: new KDA states go to the step, published with it."""

    parent: StepContext | None = None

    def stage_state(self, layer: int, name: str, value: torch.Tensor) -> None:
        self.parent.staged.append((layer, name, self.state_slots, value))


def prepare_step(cache: PagedKVCache, seq_ids: list[int], num_tokens: list[int], device,
                 max_len: int | None = None) -> StepContext:
    """Reserve room for ``num_tokens[i]`` more tokens of sequence ``seq_ids[i]`` (all-or-nothing; no
    sequence past ``max_len``) and describe the packed step as device tensors, one upload. The pieces
    must come decode rows first (every piece of one token before any longer one) and name distinct
    sequences. Nothing is committed until ``StepContext.publish``."""
    if len(seq_ids) != len(num_tokens) or not seq_ids:
        raise ValueError(f"one token count per sequence, at least one piece: {len(seq_ids)} sequences, "
                         f"{len(num_tokens)} counts")
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"a step holds one piece per sequence; got sequences {seq_ids}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in num_tokens):
        raise ValueError(f"num_tokens must be ints >= 1, got {num_tokens}")
    num_decode = next((i for i, n in enumerate(num_tokens) if n > 1), len(num_tokens))
    if any(n == 1 for n in num_tokens[num_decode:]):
        raise ValueError(f"the pieces of one token (decode rows) must come first, got lengths {num_tokens}")
    with cache._lock:
        starts = [cache.seq_len(s) for s in seq_ids]
        for sid, start, n in zip(seq_ids, starts, num_tokens):
            if max_len is not None and start + n > max_len:
                raise ValueError(f"sequence {sid} would hold {start + n} tokens, more than max_seq_len = {max_len}")
        tables_before = {sid: len(cache.block_table(sid)) for sid in seq_ids}
        cache.reserve({sid: s + n for sid, s, n in zip(seq_ids, starts, num_tokens)})
        table = cache.block_table_tensor(seq_ids, device="cpu")
        state_slots = cache.state_slots(seq_ids)
    query_start = [0]
    for n in num_tokens:
        query_start.append(query_start[-1] + n)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, num_tokens)])
    piece_of = torch.repeat_interleave(torch.arange(len(seq_ids)), torch.tensor(num_tokens))
    slots = paged_slots(table[piece_of], positions.unsqueeze(1), cache.block_size).reshape(-1)
    lens = torch.tensor([s + n for s, n in zip(starts, num_tokens)])
    # One upload for all metadata (a host-to-device copy per tensor would be one wait each).
    packed = torch.cat([positions, slots.long(), table.reshape(-1).long(), lens, state_slots,
                        torch.tensor(query_start)]).to(device)
    P, N = len(seq_ids), query_start[-1]
    pos, slot_mapping, tab, context_lens, slots_dev, qsl = packed.split([N, N, table.numel(), P, P, P + 1])
    return StepContext(cache, list(seq_ids), starts, query_start, num_decode, pos, slot_mapping,
                       tab.view(table.shape).int(), context_lens.int(), slots_dev, qsl.int(), tables_before)
