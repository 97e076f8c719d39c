"""Records of what the sparse attention and the residual mixers did: for plots, notebooks and tests.

``ForwardTrace`` is filled by one forward (``model(ids, trace=tr)``); ``GenerationTrace`` collects,
for one generated sequence, a row per token across the prefill and every decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..cache.step import StepContext


@dataclass
class ForwardTrace:
    """What one forward did.

    selected[layer]: int32 [B, T, topk] key positions chosen by the DSA indexer of MLA layer ``layer``.
    depth_weights[mixer]: [N, B, T] softmax weights of an AttnRes mixer over its N sources (stored
    blocks, then the partial sum); mixers are named "{layer}.attn", "{layer}.ffn" and "out".

    ``held`` (an ``acceptance.HeldChoices``) records the discrete choices this forward makes (which keys each
    indexer selects, which experts each router picks) or makes it take recorded ones instead: the door
    through which two paths are compared on the same choices (``held_choice``). ``pieces`` is the token
    axis as (cache sequence id or None, tokens) in order, set by the forward that runs the layers; a layer
    called alone on [B, T] rows counts them as B pieces of no sequence.
    """

    selected: dict[int, torch.Tensor] = field(default_factory=dict)
    depth_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    held: object | None = None
    pieces: list[tuple[int | None, int]] | None = None


def token_pieces(ctx, rows: int, tokens: int) -> list[tuple[int | None, int]]:
    """(cache sequence id or None, tokens) along a forward's token axis: a packed step's pieces (decode rows
    first), a cached forward's rows, or ``rows`` rows of no sequence."""
    if ctx is None:
        return [(None, tokens)] * rows
    if isinstance(ctx, StepContext):
        return ctx.pieces_on_axis(True) + ctx.pieces_on_axis(False)
    return [(sid, tokens) for sid in ctx.seq_ids]


def held_choice(trace: ForwardTrace | None, module, pieces: Callable[[], list], compute: Callable,
                flat: Callable = lambda c: c, unflat: Callable = lambda f: f):
    """A layer's discrete choice under ``trace``: compute() (the choice, or a tuple led by it), unless the trace
    holds choices (``acceptance.HeldChoices.take``): ``flat`` lays a computed choice out as [N, ...] over
    ``pieces()`` (sequence id, tokens) in order and ``unflat`` turns such rows back into what compute() returns.
    Without held choices nothing else runs (a compiled step traces compute() alone)."""
    held = None if trace is None else trace.held
    return compute() if held is None else held.take(module, pieces(), compute, flat, unflat)


@dataclass
class GenerationTrace:
    """What the sparse attention did for one generated sequence.

    ``selected[layer]`` is int32 [len(token_ids), topk]: row t holds the key positions the query at
    position t selected in that MLA layer (descending index score, -1 = padding). Every token has a
    row: the prompt's (from prefill) and each generated one (fed back through the model once).
    ``depth_weights[mixer]`` is [len(token_ids), N]: the Block-AttnRes softmax weights of that mixer
    ("{layer}.attn", "{layer}.ffn", "out") over its N sources (stored blocks, then the partial sum).
    """

    token_ids: list[int]  # prompt ids (bos first, each <|media_pad|> expanded to its image's tokens), then generated
    prompt_len: int  # number of prompt ids, bos included
    text: str = ""  # decoded generated text
    selected: dict[int, torch.Tensor] = field(default_factory=dict)
    depth_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    image_positions: list[int] = field(default_factory=list)  # positions holding image tokens

    def image_keys(self, layer: int) -> torch.Tensor:
        """bool [len(token_ids), topk]: which keys selected in MLA layer ``layer`` were image tokens."""
        is_image = torch.zeros(len(self.token_ids) + 1, dtype=torch.bool)
        is_image[torch.tensor(self.image_positions, dtype=torch.long)] = True
        sel = self.selected[layer].long()
        return torch.where(sel >= 0, is_image[sel.clamp_min(0)], torch.zeros_like(sel, dtype=torch.bool))

    def append(self, forward_trace: ForwardTrace | None, row: int) -> None:
        """Add batch row ``row`` of one forward's trace (its T tokens) to this sequence's rows."""
        if forward_trace is None:
            return
        self._add(forward_trace, lambda v: v[row], lambda v: v[:, row])

    def append_span(self, forward_trace: ForwardTrace | None, start: int, end: int) -> None:
        """Add tokens [start, end) of a packed forward's trace (one row of N tokens: an engine step's pieces)."""
        if forward_trace is None:
            return
        self._add(forward_trace, lambda v: v[0, start:end], lambda v: v[:, 0, start:end])

    def _add(self, forward_trace: ForwardTrace, tokens, depth_tokens) -> None:
        """Append the rows ``tokens(selected)`` [T, topk] and ``depth_tokens(weights)`` [N, T] of each table."""
        new = [(self.selected, k, tokens(v)) for k, v in forward_trace.selected.items()]
        new += [(self.depth_weights, k, depth_tokens(v).T.float()) for k, v in forward_trace.depth_weights.items()]
        for table, key, rows in new:
            rows = rows.cpu()
            table[key] = rows if key not in table else torch.cat([table[key], rows])
