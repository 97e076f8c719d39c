"""Text generation on the paged KV cache, run on the serving engine (engine.py): prefill the prompts,
then decode the batch token by token.

    text = minidsa.generate("hello", max_new_tokens=32, temperature=0)            # greedy
    texts = minidsa.generate(["a", "bb"], max_new_tokens=8, seed=1)             # a batch
    for piece in minidsa.stream("hi"): print(piece, end="")                      # streaming
    minidsa.generate("hi", trace=True).trace                                    # DSA selections

Every argument is checked before any cache block is taken (requests.py); blocks are reserved for the
whole request up front (all-or-nothing) and always given back, so a failed or abandoned request
leaves the model and its cache as they were. Calls in several threads share the model's default cache:
a call that finds it full waits its turn for the blocks the others give back (sharing.py).
"""

from __future__ import annotations

import warnings
from typing import Iterator

from tqdm.auto import tqdm

from ..cache import PagedKVCache
from ..checkpoint.loading import default_model, load
from ..model.minidsa import MiniDSA
from ..model.trace import GenerationTrace
from .engine import Engine
from .params import SamplingParams
from .requests import Request, build_request, check_prompt


class GenerationStream:
    """Iterator of text pieces (str for one prompt; (index, str) for a batch). After it is exhausted,
    ``.texts`` holds the full outputs and ``.traces`` the traces when requested.

    The request's cache sequences and blocks are given back when the stream ends, is closed (``close()``,
    or leaving ``with minidsa.stream(...) as s:``), or is dropped: breaking out of
    ``for piece in minidsa.stream(...)`` or an exception in that loop's body frees them at once.
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
    def batched(self) -> bool:
        """Whether the prompt was a list (pieces then come as (index, piece) pairs)."""
        return self._run.req.batched

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
    """The state of one request on its own Engine over the given cache; ``run()`` is the generator a
    GenerationStream wraps. The batch is admitted at once with its whole length reserved (all or
    nothing), then stepped: the prompts prefill in one packed forward, then the rows decode together."""

    def __init__(self, model: MiniDSA, req: Request, cache: PagedKVCache) -> None:
        self.model, self.req, self.cache = model, req, cache
        self.texts = [""] * len(req.prompts)
        self.num_generated = 0
        self.traces: list[GenerationTrace] | None = None

    def run(self) -> Iterator:
        req, pad = self.req, self.model.tokenizer.media_pad_id
        budget = max(self.model.config.max_seq_len, sum(len(p) for p in req.prompts))
        engine = Engine(self.model, cache=self.cache, max_num_seqs=len(req.prompts), max_num_batched_tokens=budget,
                        enable_prefix_caching=False, enable_chunked_prefill=False, cuda_graphs="off", raise_errors=True)
        traces = [GenerationTrace(list(p), len(p), image_positions=[j for j, t in enumerate(p) if t == pad])
                  if req.trace else None for p in req.prompts]
        rows = [engine.enqueue(None, p, feats, SamplingParams(req.temperature, req.top_p, 0, req.max_new_tokens, seed,
                                                              ignore_eos=not req.stop_at_eos), trace=tr)
                for p, feats, seed, tr in zip(req.prompts, req.image_features, req.seeds, traces)]
        try:
            engine.admit_all(rows)
            yield from self._steps(engine, rows)
        finally:
            for r in rows:
                if not r.finished:
                    engine.abort(r.request_id)
        for r, tr in zip(rows, traces):
            if tr is not None:
                tr.token_ids += r.output_ids
                tr.text = r.text
        self.traces = traces if req.trace else None

    def _steps(self, engine: Engine, rows: list) -> Iterator:
        """Step the engine to the end, yielding each row's new text as it is decoded."""
        index = {r.request_id: i for i, r in enumerate(rows)}
        counts = [0] * len(rows)
        with tqdm(total=len(rows) * self.req.max_new_tokens, unit="tok", leave=False,
                  disable=not self.req.progress) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    i = index[out.request_id]
                    new, counts[i] = len(out.token_ids) - counts[i], len(out.token_ids)
                    self.num_generated += new
                    bar.update(new)
                    piece, self.texts[i] = out.text[len(self.texts[i]):], out.text
                    if piece:
                        yield (i, piece) if self.req.batched else piece


class Generation(str):
    """The text of one generated sequence, a ``str`` in every way, with its ``GenerationTrace`` as ``.trace``
    (None unless generated with ``trace=True``)."""

    trace: GenerationTrace | None

    def __new__(cls, text: str, trace: GenerationTrace | None = None) -> "Generation":
        out = super().__new__(cls, text)
        out.trace = trace
        return out


def stream(prompt, model: MiniDSA | str | None = None, *, images=None, videos=None, max_new_tokens: int = 64,
           temperature: float = 0.8, top_p: float = 0.95, seed: int | None = None, trace: bool = False,
           cache: PagedKVCache | None = None, progress: bool = False, stop_at_eos: bool = True) -> GenerationStream:
    """``generate``'s request as a GenerationStream: it yields the text as it is decoded (for a batch, (index,
    piece) pairs); ``.texts`` and (with ``trace``) ``.trace`` are filled once it is exhausted. Breaking out of
    the loop, an exception in it, ``close()`` or ``with minidsa.stream(...) as s:`` gives the cache blocks back.
    Arguments, errors and the state left behind are ``generate``'s."""
    return _open(prompt, model, images=images, videos=videos, max_new_tokens=max_new_tokens, temperature=temperature,
                 top_p=top_p, seed=seed, trace=trace, cache=cache, progress=progress, stop_at_eos=stop_at_eos)


def _open(prompt, model, *, images, videos, max_new_tokens, temperature, top_p, seed, trace, cache, progress,
          stop_at_eos) -> GenerationStream:
    """The checked request on its stream: every argument checked before a cache block is taken."""
    check_prompt(prompt)
    if model is None or isinstance(model, str):
        model = default_model() if model is None else load(model)
    elif not isinstance(model, MiniDSA):
        raise TypeError(f"model must be a MiniDSA, a config name/path or None, got {type(model).__name__}")
    if cache is not None:
        model.check_cache(cache)  # type and layout, before a sequence or a block is taken from it
    req = build_request(model, prompt, images, max_new_tokens, temperature, top_p, seed, trace, progress,
                        stop_at_eos, videos)
    return GenerationStream(model, req, cache if cache is not None else model.default_cache())


def generate(prompt, model: MiniDSA | str | None = None, *, images=None, videos=None, max_new_tokens: int = 64,
             temperature: float = 0.8, top_p: float = 0.95, seed: int | None = None, trace: bool = False,
             cache: PagedKVCache | None = None, progress: bool = False, stop_at_eos: bool = True, **deprecated):
    """Continue ``prompt`` (a str, or a list of str for a batch) -> its text (a list of texts for a batch).

    Args:
        model: a MiniDSA, a preset name/path, or None for the default (the shipped trained) model.
        images: images for the prompt (a list of HxWx3 uint8 numpy arrays, torch tensors or PNG/JPEG
            paths; for a batch, one such list per prompt). The prompt marks each image's place with
            ``minidsa.tokenizer.IMAGE_MARKER`` (any text with one ``<|media_pad|>`` per image works); with no
            marker the images go before the text, any other count is a ValueError. Each ``<|media_pad|>``
            expands to its image's (h/2)*(w/2) tokens.
        videos: like images, each video a list of 1 to 4 frames of one size (arrays, tensors or paths);
            a prompt's placeholders take its images first, then its videos; a video item fills as many
            tokens as one of its frames (the frames are pooled after joint attention).
        max_new_tokens: tokens to generate per sequence (>= 1); generation stops early at eos.
        temperature: 0 = greedy argmax; > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        seed: seeds the sampler (row i of a batch uses seed + i, so it samples as it would alone);
            None draws a fresh seed.
        trace: record what the sparse attention did: each text's ``.trace`` is its GenerationTrace.
        cache: a PagedKVCache (default: the model's own); its blocks are always given back. A call that
            would fit it empty waits for the blocks other threads' calls give back (sharing.py).
        progress: show a tqdm bar over generated tokens.
        stop_at_eos: end a sequence at eos (False: always max_new_tokens, e.g. to time a model).
        deprecated: ``stream=True`` and ``return_trace=True`` still work, with a DeprecationWarning naming
            their replacements, ``minidsa.stream(...)`` and ``trace=True``.
    Returns:
        a Generation (a str with ``.trace``), or a list of them for a batch.
    Raises (model and cache stay usable): ValueError/TypeError for a bad argument, before any block is taken;
        OutOfKVBlocksError; NonFiniteLogitsError (a RuntimeError) for NaN or inf logits where a token is due.
    """
    stream, return_trace = _old_flags(deprecated)
    run = _open(prompt, model, images=images, videos=videos, max_new_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p, seed=seed, trace=trace or return_trace, cache=cache, progress=progress,
                stop_at_eos=stop_at_eos)
    if stream:
        return run
    for _ in run:
        pass
    out = [Generation(text, tr) for text, tr in zip(run.texts, run.traces or [None] * len(run.texts))]
    out = out if run.batched else out[0]
    return (out, run.trace) if return_trace else out


def _old_flags(deprecated: dict) -> tuple[bool, bool]:
    """(stream, return_trace) from ``generate``'s deprecated keywords, each used one warned about with the call
    that replaces it; any other keyword is the TypeError Python would raise."""
    unknown = set(deprecated) - {"stream", "return_trace"}
    if unknown:
        raise TypeError(f"generate() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    stream, return_trace = bool(deprecated.get("stream")), bool(deprecated.get("return_trace"))
    if stream:
        warnings.warn("minidsa.generate(..., stream=True) is deprecated: call minidsa.stream(...) with the same "
                      "arguments", DeprecationWarning, stacklevel=3)
    if return_trace:
        warnings.warn("minidsa.generate(..., return_trace=True) is deprecated: pass trace=True and read the "
                      "result's .trace (each text's, for a batch)", DeprecationWarning, stacklevel=3)
    return stream, return_trace
