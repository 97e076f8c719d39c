"""Holding the discrete choices fixed: record which keys each DSA indexer selected and which experts each
MoE router chose in one run, then make a second run take the same ones.

Why: two paths that agree to rounding (cached against full forward, one kernel against another) can
still pick different keys or experts where two candidates nearly tie, and in bf16 the rounding is large
enough that this happens somewhere in most forwards. The outputs then differ by O(1) although both paths
are right. With the choices held, what is left is the arithmetic, which a tolerance can bound. A replayed
route keeps its own affinities: only which experts is fixed, not their weights.

The door is the ``ForwardTrace`` every layer already takes: a forward run with ``trace=held.trace()`` (an
engine built with ``held_choices=held``) hands each choice to ``take``, which records it or returns the
recorded one. The record is kept per module, per sequence and along the token axis, so the replaying run
may split the tokens differently (a prefill of T tokens and then one-token decodes replay the rows of one
full forward of T + n tokens) and batch them differently (rows of one engine step replay the same prompts
run alone). ``key_of`` names the record of each piece of the token axis from its cache sequence id (None
for a forward without a cache); by default every piece is one sequence.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Iterator

import torch

from ..model.trace import ForwardTrace


class HeldChoices:
    """``with held.recording(): full(..., trace=held.trace())`` then ``with held.replaying(): cached(...,
    trace=held.trace())`` on one model. Outside both, a forward given the trace chooses as it always does."""

    def __init__(self) -> None:
        self.log: dict[tuple, list[torch.Tensor]] = {}
        self.cursor: dict[tuple, int] = {}
        self.mode: str | None = None  # "record", "replay" or None
        self.key_of: Callable[[int | None], Hashable] = lambda sid: None

    def trace(self) -> ForwardTrace:
        """A ForwardTrace that hands this forward's choices to this record."""
        return ForwardTrace(held=self)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.log = {}
        with self._mode("record"):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        self.cursor = {}
        with self._mode("replay"):
            yield

    @contextlib.contextmanager
    def _mode(self, mode: str) -> Iterator[None]:
        self.mode = mode
        try:
            yield
        finally:
            self.mode = None

    def take(self, module, pieces: list[tuple[int | None, int]], compute: Callable, flat: Callable,
             unflat: Callable):
        """A layer's choice: compute() while recording (its flat(...) [N, ...] split into ``pieces`` (sequence
        id, tokens) and kept) or choosing freely; while replaying, unflat of the recorded rows [N, ...]."""
        if self.mode == "replay":
            return unflat(torch.cat([self._replay(module, self.key_of(sid), n) for sid, n in pieces]))
        out = compute()
        if self.mode == "record":
            rows, start = flat(out), 0
            for sid, n in pieces:
                self.log.setdefault((id(module), self.key_of(sid)), []).append(rows[start:start + n])
                start += n
        return out

    def _replay(self, module, key, n: int) -> torch.Tensor:
        """The next ``n`` recorded tokens of sequence ``key`` -> [n, ...]."""
        whole = self.log.get((id(module), key), [])
        whole = torch.cat(whole) if whole else torch.empty(0)
        start = self.cursor.get((id(module), key), 0)
        if start + n > whole.shape[0]:
            raise RuntimeError(f"the replaying run asked {module.__class__.__name__} for tokens {start}..{start + n} "
                               f"of sequence {key!r} but the recorded run made only {whole.shape[0]}: the two runs "
                               f"do not cover the same tokens")
        self.cursor[(id(module), key)] = start + n
        return whole[start:start + n]
