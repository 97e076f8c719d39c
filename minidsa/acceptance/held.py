"""Holding the discrete choices fixed: record which keys each DSA indexer selected and which experts each
MoE router chose in one run, then make a second run take the same ones.

Why: two paths that agree to rounding (cached against full forward, one kernel against another) can
still pick different keys or experts where two candidates nearly tie, and in bf16 the rounding is large
enough that this happens somewhere in most forwards. The outputs then differ by O(1) although both paths
are right. With the choices held, what is left is the arithmetic, which a tolerance can bound. A replayed
route keeps its own affinities: only which experts is fixed, not their weights.

The record is kept per module, per sequence and along the token axis, so the replaying run may split the
tokens differently (a prefill of T tokens and then one-token decodes replay the rows of one full forward
of T + n tokens) and batch them differently (rows of one engine batch replay the same prompts run alone).
``keys`` names the sequence of each batch row of the forward in progress; by default there is one row.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from ..model.indexer import LightningIndexer
from ..model.minidsa import MiniDSA
from ..model.moe import LatentMoE


class HeldChoices:
    """``with held.recording(): full(...)`` then ``with held.replaying(): cached(...)`` on one model."""

    def __init__(self, model: MiniDSA) -> None:
        self.modules = [m for m in model.modules() if isinstance(m, (LightningIndexer, LatentMoE))]
        self.log: dict[tuple, list[torch.Tensor]] = {}
        self.cursor: dict[tuple, int] = {}
        self.keys: Callable[[], list] = lambda: [None]  # the sequence of each row of the current forward

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.log = {}
        with self._patched(replay=False):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        self.cursor = {}
        with self._patched(replay=True):
            yield

    def _record(self, module, out: torch.Tensor) -> None:
        """out [B, T, ...]: row b appended to the record of the sequence keys()[b]."""
        for b, key in enumerate(self.keys()):
            self.log.setdefault((id(module), key), []).append(out[b])

    def _replay(self, module, n: int) -> torch.Tensor:
        """The next ``n`` recorded tokens of each row's sequence -> [B, n, ...]."""
        rows = []
        for key in self.keys():
            whole = torch.cat(self.log.get((id(module), key), []) or [torch.empty(0)], dim=0)
            start = self.cursor.get((id(module), key), 0)
            if start + n > whole.shape[0]:
                raise RuntimeError(f"the replaying run asked {module.__class__.__name__} for tokens {start}..{start + n}"
                                   f" of sequence {key!r} but the recorded run made only {whole.shape[0]}: the two "
                                   f"runs do not cover the same tokens")
            self.cursor[(id(module), key)] = start + n
            rows.append(whole[start:start + n])
        return torch.stack(rows)

    @contextlib.contextmanager
    def _patched(self, replay: bool) -> Iterator[None]:
        for m in self.modules:
            if isinstance(m, LightningIndexer):
                m.select = self._selection(m, LightningIndexer.select.__get__(m), replay)
                m.select_paged = self._selection(m, LightningIndexer.select_paged.__get__(m), replay)
            else:
                m.choose = self._route(m, replay)
        try:
            yield
        finally:
            for m in self.modules:  # the instance attributes go; the class's methods show through again
                for name in ("select", "select_paged", "choose"):
                    m.__dict__.pop(name, None)

    def _selection(self, m: LightningIndexer, fn, replay: bool):
        def call(q, *args):  # q [B, T, H, D] -> int32 [B, T, topk]
            if replay:
                return self._replay(m, q.shape[1]).to(q.device)
            out = fn(q, *args)
            self._record(m, out)
            return out
        return call

    def _route(self, m: LatentMoE, replay: bool):
        def call(logits):  # logits [N, E] -> ids [N, top_k], weights; N = B * T tokens, row-major
            B, N = len(self.keys()), logits.shape[0]
            if replay:
                ids = self._replay(m, N // B).reshape(N, -1).to(logits.device)
                return ids, m.route_weights(torch.sigmoid(logits), ids)
            ids, weights = LatentMoE.choose(m, logits)
            self._record(m, ids.reshape(B, N // B, -1))
            return ids, weights
        return call
