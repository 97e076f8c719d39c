"""Text generation on the paged KV cache: prefill each prompt, then decode the batch token by token.

    text = minidsa.generate("hello", max_new_tokens=32, temperature=0)            # greedy
    texts = minidsa.generate(["a", "bb"], max_new_tokens=8, seed=1)             # a batch
    for piece in minidsa.generate("hi", stream=True): print(piece, end="")       # streaming
    text, trace = minidsa.generate("hi", return_trace=True)                     # DSA selections

Every argument is checked before any cache block is taken (requests.py); blocks are reserved for the
whole request up front (all-or-nothing) and always given back, so a failed or abandoned request
leaves the model and its cache as they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from tqdm.auto import tqdm

from ..cache import PagedKVCache
from ..checkpoint.loading import default_model, load
from ..model.minidsa import MiniDSA
from ..model.trace import ForwardTrace, GenerationTrace
from .requests import Request, build_request, check_prompt
from .sampling import sample_next_token


@dataclass
class _Sequence:
    """One prompt's progress: its cache sequence, sampler, text decoder, trace and generated ids."""

    index: int  # row in the request
    sid: int
    generator: torch.Generator
    decoder: object  # the tokenizer's incremental UTF-8 decoder
    trace: GenerationTrace
    out: list[int] = field(default_factory=list)
    pending: int | None = None  # sampled, not yet fed to the model
    text: str = ""


class GenerationStream:
    """Iterator of text pieces (str for one prompt; (index, str) for a batch). After it is exhausted,
    ``.texts`` holds the full outputs and ``.traces`` the traces when requested.

    The request's cache sequences and blocks are given back when the stream ends, is closed (``close()``,
    or leaving ``with generate(..., stream=True) as s:``), or is dropped: breaking out of
    ``for piece in generate(..., stream=True)`` or an exception in that loop's body frees them at once.
    The generator that does the work holds a ``_Run``, never the stream, so no reference cycle waits
    for the garbage collector."""

    def __init__(self, model: MiniDSA, req: Request, cache: PagedKVCache) -> None:
        self._run = _Run(model, req, cache)
        self._it = self._run.run()

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self):
        return next(self._it)

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop early and give the request's cache sequences and blocks back."""
        self._it.close()

    @property
    def texts(self) -> list[str]:
        return self._run.texts

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far, all sequences together."""
        return self._run.num_generated

    @property
    def traces(self) -> list[GenerationTrace] | None:
        return self._run.traces

    @property
    def trace(self) -> GenerationTrace | list[GenerationTrace] | None:
        if self._run.traces is None:
            return None
        return self._run.traces if self._run.req.batched else self._run.traces[0]


class _Run:
    """The state and steps of one request; ``run()`` is the generator a GenerationStream wraps."""

    def __init__(self, model: MiniDSA, req: Request, cache: PagedKVCache) -> None:
        self.model, self.req, self.cache = model, req, cache
        self.texts = [""] * len(req.prompts)
        self.num_generated = 0
        self.traces: list[GenerationTrace] | None = None

    def run(self) -> Iterator:
        sids: list[int] = []
        try:
            for _ in self.req.prompts:
                sids.append(self.cache.add_sequence())  # one by one, so a failure frees the earlier ones
            self.cache.reserve({sid: len(p) + self.req.max_new_tokens for sid, p in zip(sids, self.req.prompts)})
            yield from self._loop(sids)
        finally:
            for sid in sids:
                self.cache.free(sid)

    def _loop(self, sids: list[int]) -> Iterator:
        """Prefill every prompt (one at a time: lengths differ), then decode the live rows together."""
        req, pad = self.req, self.model.tokenizer.media_pad_id
        seqs = [_Sequence(i, sid, torch.Generator().manual_seed(seed), self.model.tokenizer.stream_decoder(),
                          GenerationTrace(list(p), len(p), image_positions=[j for j, t in enumerate(p) if t == pad]))
                for i, (sid, seed, p) in enumerate(zip(sids, req.seeds, req.prompts))]
        with tqdm(total=len(seqs) * req.max_new_tokens, unit="tok", leave=False, disable=not req.progress) as bar:
            for i, seq in enumerate(seqs):
                logits = self._forward([seq], [req.prompts[i]], req.image_features[i])
                yield from self._sample(seq, logits[0, -1], bar)
            # A finished row is fed its last token once more only to record that token's selections.
            while live := [s for s in seqs if s.pending is not None and (not self._done(s) or req.return_trace)]:
                logits = self._forward(live, [[s.pending] for s in live])
                for seq, row in zip(live, logits[:, -1]):
                    seq.pending = None
                    if not self._done(seq):
                        yield from self._sample(seq, row, bar)
        for seq in seqs:
            seq.trace.text = seq.text
        if req.return_trace:
            self.traces = [s.trace for s in seqs]

    def _forward(self, seqs: list[_Sequence], ids: list[list[int]], images: list[torch.Tensor] = ()) -> torch.Tensor:
        """One cached forward of ``ids`` (one row per sequence) -> logits [B, T, vocab]; records the traces."""
        tr = ForwardTrace() if self.req.return_trace else None
        with torch.inference_mode():
            x = torch.tensor(ids, device=self.model.device)
            sids = [s.sid for s in seqs]
            if images:  # image tokens enter the cache through the same prefill as text
                logits = self.model(inputs_embeds=self.model.embed(x, images), cache=self.cache, seq_ids=sids, trace=tr)
            else:
                logits = self.model(x, cache=self.cache, seq_ids=sids, trace=tr)
        for row, seq in enumerate(seqs):
            seq.trace.append(tr, row)
        return logits

    def _sample(self, seq: _Sequence, logits: torch.Tensor, bar) -> Iterator:
        """Draw the sequence's next token (only ids the tokenizer knows) and yield its text piece, if any."""
        logits = logits.float().cpu().clone()
        logits[self.model.tokenizer.vocab_size:] = float("-inf")  # padding ids of the embedding table
        token = sample_next_token(logits, self.req.temperature, self.req.top_p, seq.generator)
        seq.pending = token
        seq.out.append(token)
        seq.trace.token_ids.append(token)
        self.num_generated += 1
        bar.update(1)
        piece = seq.decoder.push(token)  # special tokens (eos too) add no text
        if self._done(seq):
            piece += seq.decoder.flush()
        seq.text += piece
        self.texts[seq.index] = seq.text
        if piece:
            yield (seq.index, piece) if self.req.batched else piece

    def _done(self, seq: _Sequence) -> bool:
        at_eos = self.req.stop_at_eos and bool(seq.out) and seq.out[-1] == self.model.tokenizer.eos_id
        return len(seq.out) >= self.req.max_new_tokens or at_eos


def generate(prompt, model: MiniDSA | str | None = None, *, images=None, videos=None, max_new_tokens: int = 64,
             temperature: float = 0.8, top_p: float = 0.95, seed: int | None = None, stream: bool = False,
             return_trace: bool = False, cache: PagedKVCache | None = None, progress: bool = False,
             stop_at_eos: bool = True):
    """Continue ``prompt`` (a str, or a list of str for a batch).

    Args:
        model: a MiniDSA, a preset name/path, or None for the default (the shipped trained) model.
        images: images for the prompt (a list of HxWx3 uint8 numpy arrays, torch tensors or PNG/JPEG
            paths; for a batch, one such list per prompt). The prompt marks each image's place with
            ``minidsa.tokenizer.IMAGE_MARKER`` (any text containing one ``<|media_pad|>`` per image
            works); a prompt with no marker gets the images before its text. Each ``<|media_pad|>``
            expands to its image's (h/2)*(w/2) tokens.
        videos: like images, each video a list of 1 to 4 frames of one size (arrays, tensors or paths);
            a prompt's placeholders take its images first, then its videos; a video item fills as many
            tokens as one of its frames (the frames are pooled after joint attention).
        max_new_tokens: tokens to generate per sequence (>= 1); generation stops early at eos.
        temperature: 0 = greedy argmax; > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        seed: seeds the sampler (row i of a batch uses seed + i, so it samples as it would alone);
            None draws a fresh seed.
        stream: return a GenerationStream that yields text pieces as they are decoded (for a batch,
            (index, piece) pairs); its ``.trace`` is filled when it is exhausted. Breaking out of the
            loop, an exception in it, ``close()`` or ``with ... as s:`` gives the cache blocks back.
        return_trace: also return a GenerationTrace (one per prompt for a batch).
        cache: a PagedKVCache to use (default: the model's own); its blocks are always given back.
        progress: show a tqdm bar over generated tokens.
        stop_at_eos: end a sequence when it samples eos (False: always max_new_tokens, e.g. to time a
            model that would stop early).
    Returns:
        str (list[str] for a batch), or (texts, traces) with return_trace, or a GenerationStream.
    """
    check_prompt(prompt)
    if model is None or isinstance(model, str):
        model = default_model() if model is None else load(model)
    elif not isinstance(model, MiniDSA):
        raise TypeError(f"model must be a MiniDSA, a config name/path or None, got {type(model).__name__}")
    if cache is not None:
        model.check_cache(cache)  # type and layout, before a sequence or a block is taken from it
    req = build_request(model, prompt, images, max_new_tokens, temperature, top_p, seed, return_trace, progress,
                        stop_at_eos, videos)
    run = GenerationStream(model, req, cache if cache is not None else model.default_cache())
    if stream:
        return run
    for _ in run:
        pass
    out = run.texts if req.batched else run.texts[0]
    return (out, run.trace) if return_trace else out
