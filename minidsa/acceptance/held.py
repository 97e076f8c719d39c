"""Holding the discrete choices fixed: record which keys each DSA indexer selected and which experts each
MoE router chose in one run, then make a second run take the same ones.

Why: two paths that agree to rounding (cached against full forward, one kernel against another) can
still pick different keys or experts where two candidates nearly tie, and in bf16 the rounding is large
enough that this happens somewhere in most forwards. The outputs then differ by O(1) although both paths
are right. With the choices held, what is left is the arithmetic, which a tolerance can bound. A replayed
route keeps its own affinities: only which experts is fixed, not their weights.

The record is kept per module and along the token axis, so the replaying run may split the tokens
differently (a prefill of T tokens and then one-token decodes replay the rows of one full forward of
T + n tokens). Batch size 1: the token axis of a MoE call is then the sequence.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..model.indexer import LightningIndexer
from ..model.minidsa import MiniDSA
from ..model.moe import LatentMoE


class HeldChoices:
    """``with held.recording(): full(...)`` then ``with held.replaying(): cached(...)`` on one model."""

    def __init__(self, model: MiniDSA) -> None:
        self.modules = [m for m in model.modules() if isinstance(m, (LightningIndexer, LatentMoE))]
        self.log: dict[int, list[torch.Tensor]] = {}
        self.cursor: dict[int, int] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.log = {id(m): [] for m in self.modules}
        with self._patched(replay=False):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        self.cursor = {id(m): 0 for m in self.modules}
        with self._patched(replay=True):
            yield

    def _rows(self, module, n: int, axis: int) -> torch.Tensor:
        """The next ``n`` recorded rows of ``module`` along ``axis``."""
        whole = torch.cat(self.log[id(module)], dim=axis)
        start = self.cursor[id(module)]
        if start + n > whole.shape[axis]:
            raise RuntimeError(f"the replaying run asked {module.__class__.__name__} for rows {start}..{start + n} "
                               f"but the recorded run made only {whole.shape[axis]}: the two runs do not cover "
                               f"the same tokens")
        self.cursor[id(module)] = start + n
        return whole.narrow(axis, start, n)

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
                return self._rows(m, q.shape[1], 1).to(q.device)
            out = fn(q, *args)
            self.log[id(m)].append(out)
            return out
        return call

    def _route(self, m: LatentMoE, replay: bool):
        def call(s):  # s [N, E] -> ids [N, top_k], weights
            if replay:
                ids = self._rows(m, s.shape[0], 0).to(s.device)
                return ids, m.route_weights(s, ids)
            ids, weights = LatentMoE.choose(m, s)
            self.log[id(m)].append(ids)
            return ids, weights
        return call
