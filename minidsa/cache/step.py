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

A step may also be laid out to a ``StepShape`` fixed in advance, so that a CUDA graph captured for that
shape can replay it (serving/step_graphs.py): decode rows padded to D', the prefill tokens packed and padded
to a fixed count, and the rectangle fixed at [P', T_max]; padding tokens and rows sit at position -1 and
slot -1 as above. Only the attention-like ops pay for the rectangle's padding (and the chunk form and the
indexer's kernel skip most of it); the projections and the MoE see the packed tokens. A piece's ``row`` is
where it lies in that layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..ops import paged_kv_slots
from .paged import CacheContext, PagedKVCache


@dataclass(frozen=True)
class StepShape:
    """The padded layout of a step whose shapes are fixed in advance (a CUDA graph's: every tensor the forward
    reads has one size per shape). The token axis holds ``decode_rows`` rows of one token, then the prefill
    pieces back to back and padding tokens up to ``tokens``; the attention-like ops see the prefill as a
    rectangle of ``pieces`` rows of ``piece_len`` (``pad``), a piece at the start of its row. Rows past the
    real pieces and tokens past the real ones are padding (position -1, slot -1, block table -1, context
    length 0, state slot 0 read but never written)."""

    decode_rows: int  # D': >= the step's decode pieces
    pieces: int  # P': >= its prefill pieces
    piece_len: int  # T_max: >= its longest prefill piece
    table_width: int  # block-table columns: >= its longest sequence's blocks (the indexer scores this many keys)
    kept: int = 0  # KDA states kept inside prefill pieces (prefix-cache checkpoints): >= the step's; padding skipped
    tokens: int = 0  # prefill tokens on the axis: >= the step's, <= pieces * piece_len (0: pieces * piece_len)

    @property
    def prefill_tokens(self) -> int:
        return self.tokens or self.pieces * self.piece_len

    @property
    def num_tokens(self) -> int:
        return self.decode_rows + self.prefill_tokens

    @property
    def num_rows(self) -> int:
        return self.decode_rows + self.pieces


@dataclass
class StepContext:
    """Where the tokens of one packed forward go and what they may read: P pieces on R rows, decode rows first
    (R = P unless the step is laid out to a StepShape, whose padding rows belong to no piece)."""

    cache: PagedKVCache
    seq_ids: list[int]  # cache sequence of each piece
    starts: list[int]  # tokens each sequence held before this step (its computed length, host)
    lengths: list[int]  # tokens of each piece (host)
    rows: list[int]  # the row of each piece (host)
    query_start: list[int]  # [R + 1] host: row r is tokens query_start[r] .. query_start[r + 1]
    num_decode: int  # rows of one token, placed first: they run the decode forms together
    positions: torch.Tensor  # int64 [N] absolute position of each token in its sequence, -1 on padding
    kv_slots: torch.Tensor  # int64 [N] physical KV slot of each token, -1 on padding
    block_table: torch.Tensor  # int32 [R, width], -1 past each sequence's last block
    context_lens: torch.Tensor  # int32 [R] tokens each sequence holds once the step's are stored
    state_slots: torch.Tensor  # int64 [R] KDA state slot of each row's sequence
    query_start_loc: torch.Tensor  # int32 [R + 1] query_start on the device (for varlen kernels)
    prefill_max: int = 0  # T_max: tokens of the longest prefill row
    ragged: bool = False  # some prefill row holds fewer than T_max real tokens (KDA must mask the rest)
    prefill_dest: torch.Tensor | None = None  # int64 [N - num_decode]: each prefill token's row * T_max + column
    prefill_positions: torch.Tensor | None = None  # int64 [P', T_max]: positions, -1 on padding (when ragged)
    prefill_lengths: torch.Tensor | None = None  # int64 [P'] real tokens of each prefill row (device)
    logits_indices: torch.Tensor | None = None  # int64 [S] the last token of each row whose logits lm_head computes
    sampled: list[int] = field(default_factory=list)  # of ``sample``'s pieces, their rows of lm_head's output
    packed: torch.Tensor | None = None  # the one device tensor every tensor above is a view of
    tables_before: dict = field(default_factory=dict)  # blocks each sequence owned before this step
    staged: list = field(default_factory=list)  # (cache layer, state name, state slots, new state, decode part?)
    keep: torch.Tensor | None = None  # int64 [M, 2] (prefill row, tokens into it): KDA states to keep; row -1: padding
    kept: list = field(default_factory=list)  # (cache layer, state name, the kept states [M, ...])

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @property
    def num_pieces(self) -> int:
        return len(self.seq_ids)

    @property
    def prefill_rows(self) -> int:
        return len(self.query_start) - 1 - self.num_decode

    @property
    def decode_pieces(self) -> int:
        """Pieces of one token (the first ones)."""
        return sum(1 for r in self.rows if r < self.num_decode)

    def pieces_on_axis(self, decode: bool) -> list[tuple[int, int]]:
        """(sequence id, tokens) of the decode pieces (or the prefill ones) in the order of the token axis."""
        n = self.num_decode
        return [(s, k) for r, s, k in sorted(zip(self.rows, self.seq_ids, self.lengths)) if (r < n) == decode]

    def span(self, i: int) -> tuple[int, int]:
        """Token range [a, b) of piece ``i``."""
        a = self.query_start[self.rows[i]]
        return a, a + self.lengths[i]

    def decode_part(self) -> CacheContext:
        """The decode rows as a [num_decode, 1] context (the rectangle decode's)."""
        n, d = self.num_decode, self.decode_pieces
        return _Part(self.cache, self.seq_ids[:d], self.starts[:d], self.positions[:n].view(n, 1),
                     self.kv_slots[:n], self.block_table[:n], self.context_lens[:n], self.state_slots[:n],
                     parent=self, decode=True)

    @property
    def padded(self) -> bool:
        """Whether ``pad`` copies the prefill tokens into a rectangle (pieces of different lengths, packed tight)."""
        return self.prefill_dest is not None

    def prefill_part(self) -> CacheContext:
        """Every prefill row as one [P', T_max] context (past a piece's end: position and slot -1)."""
        n, d = self.num_decode, self.decode_pieces
        a = self.query_start[n]
        if self.padded:
            kv_slots = self.pad(self.kv_slots[a:].unsqueeze(0), fill=-1).reshape(-1)
        else:
            kv_slots = self.kv_slots[a:]
        positions = self.positions[a:].view(self.prefill_rows, self.prefill_max) if self.prefill_positions is None \
            else self.prefill_positions
        return _Part(self.cache, self.seq_ids[d:], self.starts[d:], positions, kv_slots, self.block_table[n:],
                     self.context_lens[n:], self.state_slots[n:], parent=self, decode=False)

    def pad(self, t: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """The prefill tokens of ``t`` -> [P', T_max, ...], ``fill`` in the padding. ``t`` is [1, N, ...] (the
        packed axis) or [1, N - num_decode, ...] (the prefill tokens alone)."""
        first = self.query_start[self.num_decode] if t.shape[1] == self.num_tokens else 0
        flat = t[0, first:]
        P = self.prefill_rows
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
        """The forward succeeded: write the staged KDA states of the pieces' rows and commit the new lengths
        (a padding row's state is never written)."""
        d = self.decode_pieces
        for layer, name, state_slots, value, decode in self.staged:
            real = d if decode else self.num_pieces - d  # a part's pieces fill its first rows
            self.cache.write_state(layer, name, state_slots[:real], value[:real])
        for sid, start, n in zip(self.seq_ids, self.starts, self.lengths):
            self.cache.commit(sid, start + n)


@dataclass
class _Part(CacheContext):
    """A view of the decode or the prefill rows of a StepContext: new KDA states go to the step, published with it."""

    parent: StepContext | None = None
    decode: bool = False

    def stage_state(self, layer: int, name: str, value: torch.Tensor) -> None:
        self.parent.staged.append((layer, name, self.state_slots, value, self.decode))


def _check_pieces(seq_ids: list[int], num_tokens: list[int], allow_none: bool = False) -> int:
    """ValueError unless the pieces make a step (distinct sequences, counts >= 1, decode rows first);
    returns the number of decode pieces."""
    if len(seq_ids) != len(num_tokens) or not (seq_ids or allow_none):
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


def _keep_pairs(keep: Sequence[tuple[int, int]], num_tokens: list[int], num_decode: int, lay: dict,
                capacity: int) -> torch.Tensor:
    """int64 [capacity, 2]: ``keep``'s (piece, tokens into it) pairs as (prefill row, tokens), then padding pairs."""
    if len(keep) > capacity:
        raise ValueError(f"{len(keep)} kept states do not fit the step's {capacity}")
    out = torch.tensor([-1, 0], dtype=torch.long).repeat(capacity, 1)
    for m, (i, t) in enumerate(keep):
        if not num_decode <= i < len(num_tokens) or not 0 < t < num_tokens[i]:
            raise ValueError(f"keep pair (piece {i}, {t} tokens) is not inside a prefill piece; pieces "
                             f"{num_decode}.. hold {num_tokens[num_decode:]} tokens")
        out[m, 0], out[m, 1] = lay["rows"][i] - lay["num_decode"], t
    return out


def _tight_layout(starts: list[int], num_tokens: list[int], num_decode: int, table: torch.Tensor,
                  sample: Sequence[int]) -> dict:
    """The pieces back to back (R = P rows); the prefill rectangle is built by ``pad`` when lengths differ."""
    query_start = [0]
    for n in num_tokens:
        query_start.append(query_start[-1] + n)
    lengths = num_tokens[num_decode:]
    t_max = max(lengths, default=0)
    padded = len(set(lengths)) > 1  # pieces of one length are a rectangle already
    dest, pad_pos = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    if padded:
        taken, pad_pos = _rectangle(starts[num_decode:], lengths, len(lengths), t_max)
        dest = taken.nonzero().view(-1)
    return dict(query_start=query_start, rows=list(range(len(num_tokens))), num_decode=num_decode, t_max=t_max,
                ragged=padded, table=table, dest=dest, pad_pos=pad_pos,
                logits_rows=[query_start[i + 1] - 1 for i in sample], sampled=list(range(len(sample))))


def _rectangle(starts: list[int], lengths: list[int], rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pieces of ``lengths`` tokens (from positions ``starts``) at the start of the rows of a [rows, width]
    rectangle -> (bool [rows * width]: the places they take, int64 [rows, width]: their positions, -1 elsewhere)."""
    taken = torch.zeros(rows * width, dtype=torch.bool)
    positions = torch.full((rows, width), -1, dtype=torch.long)
    for r, (s, n) in enumerate(zip(starts, lengths)):
        taken[r * width: r * width + n] = True
        positions[r, :n] = torch.arange(s, s + n)
    return taken, positions


def _shaped_layout(starts: list[int], num_tokens: list[int], num_decode: int, table: torch.Tensor,
                   sample: Sequence[int], shape: StepShape) -> dict:
    """The pieces laid out to ``shape`` (R = its rows): decode rows padded to D', the prefill pieces back to back,
    padding tokens after them (in the rectangle they fill the rows' unused places); lm_head reads the last real
    token of every row."""
    lengths = num_tokens[num_decode:]
    if num_decode > shape.decode_rows or len(lengths) > shape.pieces or max(lengths, default=0) > shape.piece_len \
            or table.shape[1] > shape.table_width or sum(lengths) > shape.prefill_tokens:
        raise ValueError(f"the step (decode pieces {num_decode}, prefill lengths {lengths}, {table.shape[1]} "
                         f"blocks) does not fit {shape}")
    D, T, P = shape.decode_rows, shape.piece_len, shape.pieces
    rows = list(range(num_decode)) + [D + j for j in range(len(lengths))]
    query_start = list(range(D + 1))
    for n in lengths + [0] * (P - len(lengths)):
        query_start.append(query_start[-1] + n)
    query_start[-1] = shape.num_tokens  # the last row's range runs over the padding tokens
    taken, pad_pos = _rectangle(starts[num_decode:], lengths, P, T)
    real = taken.nonzero().view(-1)  # the real tokens' places, in piece order
    dest = torch.cat([real, (~taken).nonzero().view(-1)[: shape.prefill_tokens - real.numel()]])
    wide = torch.full((shape.num_rows, shape.table_width), -1, dtype=torch.int32)
    wide[rows, : table.shape[1]] = table
    row_len = torch.zeros(shape.num_rows, dtype=torch.long)
    row_len[rows] = torch.tensor(num_tokens, dtype=torch.long)
    logits_rows = (torch.tensor(query_start[:-1]) + (row_len - 1).clamp_min(0)).clamp_max(shape.num_tokens - 1)
    return dict(query_start=query_start, rows=rows, num_decode=D, t_max=T, ragged=True, table=wide,
                dest=dest, pad_pos=pad_pos, logits_rows=logits_rows.tolist(), sampled=[rows[i] for i in sample])


def _host_tensors(cache: PagedKVCache, seq_ids: list[int], starts: list[int], num_tokens: list[int],
                  lay: dict) -> list[torch.Tensor]:
    """The step's metadata on the host, in upload order: positions, KV slots, block table, context lengths, state
    slots, query starts, the pad destinations and positions, the prefill rows' lengths, the lm_head rows."""
    query_start, rows, R = lay["query_start"], lay["rows"], len(lay["query_start"]) - 1
    N = query_start[-1]
    positions = torch.full((N,), -1, dtype=torch.long)
    token_row = torch.zeros(N, dtype=torch.long)
    if rows:  # every real token at once: a step may hold one piece per running sequence
        counts, row_t = torch.tensor(num_tokens), torch.tensor(rows)
        piece = torch.repeat_interleave(torch.arange(len(rows)), counts)
        offset = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[piece]
        at = torch.tensor(query_start)[row_t][piece] + offset
        positions[at] = torch.tensor(starts)[piece] + offset
        token_row[at] = row_t[piece]
    wide = lay["table"]
    kv_slots = paged_kv_slots(wide, positions, cache.block_size, rows=token_row) if N and wide.shape[1] else \
        torch.full_like(positions, -1)
    lens, state, lengths = (torch.zeros(R, dtype=torch.long) for _ in range(3))
    if rows:
        lens[rows] = torch.tensor([s + n for s, n in zip(starts, num_tokens)])
        state[rows] = cache.state_slots(seq_ids)
        lengths[rows] = torch.tensor(num_tokens)
    return [positions, kv_slots.long(), wide.reshape(-1).long(), lens, state, torch.tensor(query_start), lay["dest"],
            lay["pad_pos"].reshape(-1), lengths[lay["num_decode"]:], torch.tensor(lay["logits_rows"], dtype=torch.long)]


def prepare_step(cache: PagedKVCache, seq_ids: list[int], num_tokens: list[int], device,
                 max_len: int | None = None, sample: Sequence[int] = (), shape: StepShape | None = None,
                 into: StepContext | None = None, keep: Sequence[tuple[int, int]] = ()) -> StepContext:
    """Reserve room for ``num_tokens[i]`` more tokens of sequence ``seq_ids[i]`` (all-or-nothing; no
    sequence past ``max_len``) and describe the packed step as device tensors, one upload. The pieces
    must come decode rows first (every piece of one token before any longer one) and name distinct
    sequences; ``sample``: the pieces whose last token's logits are wanted (``logits_indices``). With
    ``shape``, the step is laid out to it (no pieces at all is then a valid, all-padding step), and with
    ``into`` (a step of the same shape) its metadata is copied into that step's device tensors, which a
    captured graph reads. ``keep``: (piece, t) pairs asking for the KDA states after the first t tokens of a
    prefill piece (``StepContext.kept`` receives them). Nothing is committed until ``StepContext.publish``."""
    num_decode = _check_pieces(seq_ids, num_tokens, allow_none=shape is not None)
    starts, tables_before = cache.reserve_more(seq_ids, num_tokens, max_len)
    table = cache.block_table_tensor(seq_ids, device="cpu")
    try:
        lay = _tight_layout(starts, num_tokens, num_decode, table, sample) if shape is None else \
            _shaped_layout(starts, num_tokens, num_decode, table, sample, shape)
        capacity = len(keep) if shape is None else shape.kept
        parts = _host_tensors(cache, seq_ids, starts, num_tokens, lay)
        parts.append(_keep_pairs(keep, num_tokens, num_decode, lay, capacity).reshape(-1))
        if into is not None and (into.packed.numel() != sum(p.numel() for p in parts)
                                 or into.block_table.shape != lay["table"].shape):
            raise ValueError("prepare_step(into=...) needs a step laid out to the same shape")
    except BaseException:
        cache.give_back(tables_before)  # refused: nothing stays reserved
        raise
    host, sizes = torch.cat(parts), [p.numel() for p in parts]
    new = dict(seq_ids=list(seq_ids), starts=starts, lengths=list(num_tokens), rows=lay["rows"],
               sampled=lay["sampled"], tables_before=tables_before, query_start=lay["query_start"])
    if into is not None:  # the graph's tensors keep their addresses; their int32 copies are refreshed too
        _, _, tab, context_lens, _, qsl, *_ = into.packed.copy_(host, non_blocking=True).split(sizes)
        into.block_table.copy_(tab.view(lay["table"].shape))
        into.context_lens.copy_(context_lens)
        into.query_start_loc.copy_(qsl)
        return dataclasses.replace(into, staged=[], kept=[], **new)
    packed = host.to(device)  # one upload for all metadata (a copy per tensor would be one wait each)
    pos, kv_slots, tab, context_lens, state_slots, qsl, dest, pad_pos, lengths, logit_rows, kp = packed.split(sizes)
    D, T = lay["num_decode"], lay["t_max"]
    P = len(lay["query_start"]) - 1 - D
    prefill_positions = pad_pos.view(P, T) if pad_pos.numel() else None
    return StepContext(cache, num_decode=D, positions=pos, kv_slots=kv_slots,
                       block_table=tab.view(lay["table"].shape).int(), context_lens=context_lens.int(),
                       state_slots=state_slots, query_start_loc=qsl.int(), prefill_max=T, ragged=lay["ragged"],
                       prefill_dest=dest if dest.numel() else None, prefill_positions=prefill_positions,
                       prefill_lengths=lengths, logits_indices=logit_rows, packed=packed,
                       keep=kp.view(-1, 2) if kp.numel() else None, **new)
