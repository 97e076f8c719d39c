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
``decode_part()`` and ``prefill_part()``, which are ordinary ``CacheContext``s over these tensors: the
decode and prefill code of the rectangle forward (``model(ids, cache=...)``, the reference) runs
unchanged on them.

The prefill pieces run as one rectangle [P', T_max] (P' pieces, the longest T_max tokens): ``pad`` puts
each piece's tokens in its row, the rest of the row is padding at position -1 (no causal key, so the
sparse ops select nothing and attend to nothing there; slot -1 writes nothing), and ``unpad`` takes
the real tokens back. One call of each op then serves every piece, whatever their lengths: the cost of
a step no longer grows with its number of pieces. Pieces of one length need no padding (views only).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    prefill_max: int = 0  # T_max: tokens of the longest prefill piece
    prefill_dest: torch.Tensor | None = None  # int64 [N - num_decode]: each prefill token's row * T_max + column
    prefill_positions: torch.Tensor | None = None  # int64 [P', T_max]: positions, -1 where a row is padding
    prefill_lengths: torch.Tensor | None = None  # int64 [P'] tokens of each prefill piece (device)
    logits_indices: torch.Tensor | None = None  # int64 [S] the last token of each piece to sample (lm_head rows)
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

    @property
    def padded(self) -> bool:
        """Whether the prefill pieces differ in length (so ``pad`` copies into a padded rectangle)."""
        return self.prefill_dest is not None

    def prefill_part(self) -> CacheContext:
        """Every prefill piece as one [P', T_max] context (rows past a piece's end: position and slot -1)."""
        n, P = self.num_decode, self.num_pieces - self.num_decode
        a = self.query_start[n]
        if self.padded:
            positions = self.prefill_positions
            slots = self.pad(self.slot_mapping[a:].unsqueeze(0), fill=-1).reshape(-1)
        else:
            positions, slots = self.positions[a:].view(P, self.prefill_max), self.slot_mapping[a:]
        return _Part(self.cache, self.seq_ids[n:], self.starts[n:], positions, slots, self.block_table[n:],
                     self.context_lens[n:], self.state_slots[n:], parent=self)

    def pad(self, t: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """The prefill tokens of ``t`` -> [P', T_max, ...], ``fill`` in the padding. ``t`` is [1, N, ...] (the
        packed axis) or [1, N - num_decode, ...] (the prefill tokens alone)."""
        first = self.query_start[self.num_decode] if t.shape[1] == self.num_tokens else 0
        flat = t[0, first:]
        P = self.num_pieces - self.num_decode
        if not self.padded:
            return flat.reshape(P, self.prefill_max, *t.shape[2:])
        out = flat.new_full((P * self.prefill_max, *t.shape[2:]), fill)
        return out.index_copy_(0, self.prefill_dest, flat).view(P, self.prefill_max, *t.shape[2:])

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """[P', T_max, ...] -> the prefill tokens [1, N - num_decode, ...] in packed order (inverse of ``pad``)."""
        flat = t.reshape(-1, *t.shape[2:])
        return (flat.index_select(0, self.prefill_dest) if self.padded else flat).unsqueeze(0)

    def rollback(self) -> None:
        """The forward failed: give back the blocks this step reserved (sequences freed meanwhile are skipped)."""
        self.cache.give_back(self.tables_before)

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


def _check_pieces(seq_ids: list[int], num_tokens: list[int]) -> int:
    """ValueError unless the pieces make a step (distinct sequences, counts >= 1, decode rows first);
    returns the number of decode rows."""
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
    return num_decode


def _padding(starts: list[int], lengths: list[int], t_max: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(each prefill token's row * t_max + column [sum(lengths)], positions [P', t_max] with -1 as padding);
    empty tensors when the pieces need no padding."""
    if not padded:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    dest = torch.cat([torch.arange(n) + r * t_max for r, n in enumerate(lengths)])
    positions = torch.full((len(lengths), t_max), -1, dtype=torch.long)
    for r, (s, n) in enumerate(zip(starts, lengths)):
        positions[r, :n] = torch.arange(s, s + n)
    return dest, positions


def prepare_step(cache: PagedKVCache, seq_ids: list[int], num_tokens: list[int], device,
                 max_len: int | None = None, sample: Sequence[int] = ()) -> StepContext:
    """Reserve room for ``num_tokens[i]`` more tokens of sequence ``seq_ids[i]`` (all-or-nothing; no
    sequence past ``max_len``) and describe the packed step as device tensors, one upload. The pieces
    must come decode rows first (every piece of one token before any longer one) and name distinct
    sequences; ``sample``: the pieces whose last token's logits are wanted (``logits_indices``). Nothing is
    committed until ``StepContext.publish``."""
    num_decode = _check_pieces(seq_ids, num_tokens)
    starts, tables_before = cache.reserve_more(seq_ids, num_tokens, max_len)
    table = cache.block_table_tensor(seq_ids, device="cpu")
    state_slots = cache.state_slots(seq_ids)
    query_start = [0]
    for n in num_tokens:
        query_start.append(query_start[-1] + n)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, num_tokens)])
    piece_of = torch.repeat_interleave(torch.arange(len(seq_ids)), torch.tensor(num_tokens))
    slots = paged_slots(table[piece_of], positions.unsqueeze(1), cache.block_size).reshape(-1)
    lens = torch.tensor([s + n for s, n in zip(starts, num_tokens)])
    lengths = num_tokens[num_decode:]
    t_max = max(lengths, default=0)
    padded = len(set(lengths)) > 1  # pieces of one length are a rectangle already
    dest, pad_pos = _padding(starts[num_decode:], lengths, t_max, padded)
    # One upload for all metadata (a host-to-device copy per tensor would be one wait each).
    packed = torch.cat([positions, slots.long(), table.reshape(-1).long(), lens, state_slots,
                        torch.tensor(query_start), dest, pad_pos.reshape(-1),
                        torch.tensor(lengths, dtype=torch.long),
                        torch.tensor([query_start[i + 1] - 1 for i in sample], dtype=torch.long)]).to(device)
    P, N = len(seq_ids), query_start[-1]
    pos, slot_mapping, tab, context_lens, slots_dev, qsl, dest, pad_pos, lengths_dev, rows = packed.split(
        [N, N, table.numel(), P, P, P + 1, dest.numel(), pad_pos.numel(), len(lengths), len(sample)])
    return StepContext(cache, list(seq_ids), starts, query_start, num_decode, pos, slot_mapping,
                       tab.view(table.shape).int(), context_lens.int(), slots_dev, qsl.int(), prefill_max=t_max,
                       prefill_dest=dest if padded else None,
                       prefill_positions=pad_pos.view(len(lengths), t_max) if padded else None,
                       prefill_lengths=lengths_dev, logits_indices=rows, tables_before=tables_before)
