"""The model runner: one scheduled step of pieces in, the logits of the rows to sample out (docs/design.md §16).

The engine (engine.py) keeps the requests, the schedule and the outputs; the runner owns what touches the
model: it builds the step's metadata (``cache.prepare_step``), runs the step as one forward over packed
tokens, or on a GPU replays a captured CUDA graph (cuda_graphs.py for a uniform decode, step_graphs.py for
a step with prefill rows, laid out to its shape), computes ``lm_head`` only on the rows that end their
piece, and chooses the next tokens.

    pieces (request, start, end), decode rows first -> one StepContext -> [1, N, d] -> lm_head(rows) -> tokens

A forward that raises leaves the cache as it was (the blocks it reserved go back, no state is written), so
the engine can fail the step's requests and go on.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..cache import OutOfKVBlocksError, prepare_step
from ..model.minidsa import MiniDSA
from ..model.trace import ForwardTrace
from ..ops.mla.prefill_form import sync_free
from .cuda_graphs import DecodeGraphs
from .sampling import sample_next_token
from .step_graphs import StepGraphs, step_logits


class ModelRunner:
    """Runs the steps of one engine on its model and cache; ``graphs``: the captured decode steps, and
    ``step_graphs`` the steps with prefill rows, or None."""

    def __init__(self, model: MiniDSA, cache, max_num_seqs: int, graphs: bool, compile_decode: bool) -> None:
        self.model, self.cache = model, cache
        self.graphs = self.step_graphs = None
        if graphs:
            self.graphs = DecodeGraphs(model, cache, max_num_seqs, compile=compile_decode)
            self.graphs.capture()
            self.step_graphs = StepGraphs(model, cache, max_num_seqs, pool=self.graphs.pool)
        self.packed_steps = self.graph_steps = 0
        # how steps ran ("decode graph", "step graph", "step graph captured", "step shaped, uncaptured", "eager")
        # -> (steps, wall seconds)
        self.step_times: dict[str, tuple[int, float]] = {}
        self.last_step = None  # the StepContext of the last packed forward (for pictures and checks)

    def execute(self, pieces: list, sample: list[int], trace: ForwardTrace | None,
                keep: list[tuple[int, int]] = ()) -> tuple[torch.Tensor, list]:
        """Run ``pieces`` [(request, start, end)] (one per request, decode rows first) as one step. Returns the
        fp32 logits [len(sample), V] of the last token of each piece listed in ``sample``, on the host, and
        the KDA states that ``keep``'s (piece, tokens into it) pairs ask for, [(cache layer, state name,
        states [>= len(keep), ...])] on the device (``StepContext.kept``). ``step_times`` counts the step and
        its wall time (the logits' copy to the host waits for the GPU) under how it ran."""
        start, captures = time.perf_counter(), self.step_graphs.captures if self.step_graphs is not None else 0
        logits, kept, how = self._execute(pieces, sample, trace, keep)
        if how == "step graph" and self.step_graphs.last == "shaped":
            how = "step shaped, uncaptured"
        elif how == "step graph" and self.step_graphs.captures > captures:
            how = "step graph captured"
        n, seconds = self.step_times.get(how, (0, 0.0))
        self.step_times[how] = (n + 1, seconds + time.perf_counter() - start)
        return logits, kept

    def _execute(self, pieces: list, sample: list[int], trace: ForwardTrace | None,
                 keep: list[tuple[int, int]]) -> tuple[torch.Tensor, list, str]:
        if self.graphs is not None and trace is None and not keep and self.graphs.fits(len(pieces)) and all(
                b - a == 1 and not r.has_media_from(a) for r, a, b in pieces):
            logits = self.graphs.run([r.sid for r, _, _ in pieces], [r.tokens(a, b)[0] for r, a, b in pieces])
            self.graph_steps += 1
            return logits[sample, -1].float().cpu(), [], "decode graph"  # one device-to-host copy per step
        self.packed_steps += 1
        if self.step_graphs is not None and trace is None and not any(r.has_media_from(a) for r, a, _ in pieces):
            sids, counts = [r.sid for r, _, _ in pieces], [b - a for _, a, b in pieces]
            shape = self.step_graphs.shape_for(sids, counts, len(keep))
            if shape is not None and self.step_graphs.ready(shape):
                ids = [t for r, a, b in pieces for t in r.tokens(a, b)]
                logits, kept = self.step_graphs.run(shape, sids, counts, ids, sample, keep)
                return logits.float().cpu(), kept, "step graph"
        logits = self.forward_packed(pieces, sample, trace, keep)
        return logits.float().cpu(), self.last_step.kept, "eager"

    def forward_packed(self, pieces: list, sample: list[int], trace: ForwardTrace | None,
                       keep: list[tuple[int, int]] = ()) -> torch.Tensor:
        """The step as one forward over its packed tokens -> logits [len(sample), V] (device)."""
        m = self.model
        step = prepare_step(self.cache, [r.sid for r, _, _ in pieces], [b - a for _, a, b in pieces], m.device,
                            max_len=m.config.max_seq_len, sample=sample, keep=keep)
        self.last_step = step
        try:
            logits = step_logits(m, step, self.embeddings(pieces), trace)
        except BaseException:
            step.rollback()  # the blocks this step reserved go back; nothing was committed
            raise
        step.publish()
        return logits

    def warm_up(self, max_tokens: int) -> None:
        """Run a few steps on scratch sequences and roll each back, so that the Triton kernels of the steps a
        workload runs are compiled at start-up rather than while the first requests wait (a cold compile costs
        about a second a kernel, and a step that meets one stalls every request in it). Each step is a one-token
        row beside two prefill pieces of unequal, odd lengths, the longer one keeping a KDA state inside it (as
        the prefix cache's checkpoints do), laid out as a captured step is where the engine has step graphs (its
        padding, the sparse prefill's capture form). The longer piece is 1,023 tokens, then 2,047: the indexer's
        top-k compiles one kernel per power of two of the key range, and a 1,024-token prompt's table reaches
        2,048 keys once it decodes. At most ``max_tokens`` tokens a step; nothing stays in the cache."""
        cap = min((max_tokens - 1) // 2, self.model.config.max_seq_len - 1)
        for long in sorted({min(n, cap) | 1 for n in (1023, 2047)}):
            if long < 3 or self.cache.num_free_state_slots < 2:
                return
            self._warm_up_step(([1] if self.cache.num_free_state_slots > 2 else []) + [long, long // 2 | 1])

    def _warm_up_step(self, counts: list[int]) -> None:
        m, cache = self.model, self.cache
        chunk = m.config.kda.chunk_size
        keep = [(len(counts) - 2, chunk * max(1, counts[-2] // 2 // chunk))] if counts[-2] > chunk else []
        sids = [cache.add_sequence() for _ in counts]
        graphed = self.step_graphs is not None
        try:
            shape = self.step_graphs.shape_for(sids, counts, len(keep)) if graphed else None
            step = prepare_step(cache, sids, counts, m.device, max_len=m.config.max_seq_len,
                                sample=range(len(counts)), shape=shape, keep=keep)
            try:
                with torch.inference_mode(), sync_free() if graphed else contextlib.nullcontext():
                    ids = torch.ones(1, step.num_tokens, dtype=torch.long, device=m.device)
                    step_logits(m, step, m.language_model.model.embed_tokens(ids))
            finally:
                step.rollback()
        except OutOfKVBlocksError:
            pass
        finally:
            for sid in reversed(sids):  # the free lists back in their order
                cache.free(sid)

    def embeddings(self, pieces: list) -> torch.Tensor:
        """[1, N, d]: the token embeddings of every piece, with the media features where a piece covers them."""
        m = self.model
        ids = torch.tensor([t for r, a, b in pieces for t in r.tokens(a, b)], dtype=torch.long)
        h = m.language_model.model.embed_tokens(ids.to(m.device)).unsqueeze(0)
        at = 0
        for req, a, b in pieces:
            if req.has_media_from(a):
                if req.embeds is None:  # the whole prompt embedded once, media filled (cut into chunks later)
                    req.embeds = m.embed(torch.tensor([req.prompt_ids], device=m.device), req.features)[0]
                stop = min(b, len(req.prompt_ids))
                h[0, at: at + stop - a] = req.embeds[a:stop]
            at += b - a
        return h

    def sample(self, req, logits: torch.Tensor) -> int:
        """The next token of ``req`` from its logits [V] (host), padding ids of the embedding table excluded."""
        p = req.params
        if p.temperature == 0:  # the argmax of the real ids (no copy: the padding ids are simply not looked at)
            return int(torch.argmax(logits[: self.model.tokenizer.vocab_size]))
        logits = logits.clone()
        logits[self.model.tokenizer.vocab_size:] = float("-inf")
        return sample_next_token(logits, p.temperature, p.top_p, req.generator, p.top_k)
