"""Text generation on the paged KV cache: prefill each prompt, then decode the batch token by token.

    text = minidsa.generate("hello", max_new_tokens=32, temperature=0)            # greedy
    texts = minidsa.generate(["a", "bb"], max_new_tokens=8, seed=1)             # a batch
    for piece in minidsa.generate("hi", stream=True): print(piece, end="")       # streaming
    text, trace = minidsa.generate("hi", return_trace=True)                     # DSA selections

Every argument is checked before any cache block is taken; blocks are reserved for the whole
request up front (all-or-nothing) and always given back, so a failed or abandoned request leaves
the model and its cache as they were.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .kv_cache import PagedKVCache
from .model import ForwardTrace, MiniDSA, build_model
from .tokenizer import IMAGE_MARKER
from .vision import preprocess

_DEFAULT_MODELS: dict[str, MiniDSA] = {}
DEFAULT_MODEL = "tiny"  # no trained weights ship yet: the default is the seeded tiny model


def load(name_or_path="tiny", *, device: torch.device | str = "cpu", progress: bool = True,
         lazy_experts: bool = False) -> MiniDSA:
    """A checkpoint directory (save_pretrained's output) with its weights, or the seeded random model
    of a preset name ("tiny", "laptop", ...), a config JSON path or a ModelConfig. ``progress`` shows a
    tqdm bar while a checkpoint streams in; ``lazy_experts`` leaves routed experts on disk until a
    token is routed to them."""
    if isinstance(name_or_path, (str, os.PathLike)) and Path(name_or_path).is_dir():
        from .checkpoint import load_pretrained

        return load_pretrained(name_or_path, device=device, progress=progress, lazy_experts=lazy_experts)
    return build_model(name_or_path, device=device)


def default_model() -> MiniDSA:
    if DEFAULT_MODEL not in _DEFAULT_MODELS:
        _DEFAULT_MODELS[DEFAULT_MODEL] = load(DEFAULT_MODEL)
    return _DEFAULT_MODELS[DEFAULT_MODEL]


@dataclass
class GenerationTrace:
    """What the sparse attention did for one sequence.

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

    def _append(self, forward_trace: ForwardTrace, row: int) -> None:
        new = [(self.selected, k, v[row]) for k, v in forward_trace.selected.items()]
        new += [(self.depth_weights, k, v[:, row].T.float()) for k, v in forward_trace.depth_weights.items()]
        for table, key, rows in new:
            rows = rows.cpu()
            table[key] = rows if key not in table else torch.cat([table[key], rows])


@dataclass
class _Request:
    max_new_tokens: int
    temperature: float
    top_p: float
    seeds: list[int]
    return_trace: bool
    progress: bool
    stop_at_eos: bool


class GenerationStream:
    """Iterator of text pieces (str for one prompt; (index, str) for a batch). After it is exhausted,
    ``.texts`` holds the full outputs and ``.traces`` the traces when requested."""

    def __init__(self, model: MiniDSA, prompts: list[list[int]], req: _Request, cache: PagedKVCache,
                 batched: bool, image_features: list[list[torch.Tensor]] | None = None) -> None:
        self.model, self.prompts, self.req, self.cache, self.batched = model, prompts, req, cache, batched
        self.image_features = image_features or [[] for _ in prompts]
        self.texts = [""] * len(prompts)
        self.num_generated = 0  # tokens sampled so far, all sequences together
        self.traces: list[GenerationTrace] | None = None
        self._it = self._run()

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self):
        return next(self._it)

    def close(self) -> None:
        """Stop early and give the request's cache blocks back (also happens when the stream is garbage-collected)."""
        self._it.close()

    @property
    def trace(self) -> GenerationTrace | list[GenerationTrace] | None:
        if self.traces is None:
            return None
        return self.traces if self.batched else self.traces[0]

    def _run(self) -> Iterator:
        model, cache, req = self.model, self.cache, self.req
        tok = model.tokenizer
        n = len(self.prompts)
        sids = []
        try:
            for _ in range(n):
                sids.append(cache.add_sequence())  # appended one by one so a failure frees the earlier ones
            cache.reserve({sid: len(p) + req.max_new_tokens for sid, p in zip(sids, self.prompts)})
            gens = [torch.Generator().manual_seed(s) for s in req.seeds]
            decoders = [tok.stream_decoder() for _ in range(n)]
            pad = tok.media_pad_id
            traces = [GenerationTrace(list(p), len(p), image_positions=[j for j, t in enumerate(p) if t == pad])
                      for p in self.prompts]
            out_ids: list[list[int]] = [[] for _ in range(n)]
            bar = _progress(req.progress, n * req.max_new_tokens)

            def emit(i: int, token: int):
                out_ids[i].append(token)
                self.num_generated += 1
                traces[i].token_ids.append(token)
                piece = decoders[i].push(token)  # special tokens (eos too) add no text
                if self._finished(out_ids[i]):
                    piece += decoders[i].flush()
                self.texts[i] += piece
                bar.update(1)
                return piece

            pending: dict[int, int] = {}  # row -> sampled token not yet fed to the model
            for i, ids in enumerate(self.prompts):  # prefill: one sequence at a time (lengths differ)
                tr = ForwardTrace() if req.return_trace else None
                logits = self._forward(torch.tensor([ids]), [sids[i]], tr, self.image_features[i])
                self._record(traces[i], tr, 0)
                pending[i] = self._sample(logits[0, -1], i, gens[i])
                piece = emit(i, pending[i])
                if piece:
                    yield (i, piece) if self.batched else piece
            while pending:
                active = [i for i in sorted(pending) if self._wants_feed(i, out_ids[i])]
                if not active:
                    break
                tr = ForwardTrace() if req.return_trace else None
                tokens = torch.tensor([[pending[i]] for i in active])
                logits = self._forward(tokens, [sids[i] for i in active], tr)
                pending = {}
                for row, i in enumerate(active):
                    self._record(traces[i], tr, row)
                    if self._finished(out_ids[i]):
                        continue  # this feed only recorded the last token's selections
                    pending[i] = self._sample(logits[row, -1], i, gens[i])
                    piece = emit(i, pending[i])
                    if piece:
                        yield (i, piece) if self.batched else piece
            bar.close()
            for i, t in enumerate(traces):
                t.text = self.texts[i]
            if req.return_trace:
                self.traces = traces
        finally:
            for sid in sids:
                cache.free(sid)

    def _forward(self, ids: torch.Tensor, sids: list[int], tr: ForwardTrace | None,
                 images: list[torch.Tensor] = ()) -> torch.Tensor:
        with torch.inference_mode():
            ids = ids.to(self.model.device)
            if images:  # image tokens enter the cache through the same prefill as text
                return self.model(inputs_embeds=self.model.embed(ids, images), cache=self.cache, seq_ids=sids,
                                  trace=tr)
            return self.model(ids, cache=self.cache, seq_ids=sids, trace=tr)

    def _finished(self, out: list[int]) -> bool:
        at_eos = self.req.stop_at_eos and bool(out) and out[-1] == self.model.tokenizer.eos_id
        return len(out) >= self.req.max_new_tokens or at_eos

    def _wants_feed(self, i: int, out: list[int]) -> bool:
        # A finished sequence is fed its last token once more only to record its selections.
        return not self._finished(out) or self.req.return_trace

    def _record(self, trace: GenerationTrace, tr: ForwardTrace | None, row: int) -> None:
        if tr is not None:
            trace._append(tr, row)

    def _sample(self, logits: torch.Tensor, row: int, gen: torch.Generator) -> int:
        """logits fp32 [vocab] -> one token id, restricted to ids the tokenizer knows."""
        logits = logits.float().cpu().clone()
        logits[self.model.tokenizer.vocab_size:] = float("-inf")
        if self.req.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.req.temperature, dim=-1)
        if self.req.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True, stable=True)
            before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of strictly more likely tokens
            sorted_p = torch.where(before < self.req.top_p, sorted_p, torch.zeros_like(sorted_p))
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def _progress(enabled: bool, total: int):
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="tok", leave=False)

    class _Null:
        def update(self, n):
            pass

        def close(self):
            pass

    return _Null()


def generate(prompt, model: MiniDSA | str | None = None, *, images=None, max_new_tokens: int = 64,
             temperature: float = 0.8,
             top_p: float = 0.95, seed: int | None = None, stream: bool = False, return_trace: bool = False,
             cache: PagedKVCache | None = None, progress: bool = False, stop_at_eos: bool = True):
    """Continue ``prompt`` (a str, or a list of str for a batch).

    Args:
        model: a MiniDSA, a preset name/path, or None for the default (seeded tiny) model.
        images: images for the prompt (a list of HxWx3 uint8 numpy arrays, torch tensors or PNG/JPEG
            paths; for a batch, one such list per prompt). The prompt marks each image's place with
            ``minidsa.tokenizer.IMAGE_MARKER`` (any text containing one ``<|media_pad|>`` per image
            works); a prompt with no marker gets the images before its text. Each ``<|media_pad|>``
            expands to its image's (h/2)*(w/2) tokens.
        max_new_tokens: tokens to generate per sequence (>= 1); generation stops early at eos.
        temperature: 0 = greedy argmax; > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        seed: seeds the sampler (row i of a batch uses seed + i, so it samples as it would alone);
            None draws a fresh seed.
        stream: return a GenerationStream that yields text pieces as they are decoded (for a batch,
            (index, piece) pairs); its ``.trace`` is filled when it is exhausted.
        return_trace: also return a GenerationTrace (one per prompt for a batch).
        cache: a PagedKVCache to use (default: the model's own); its blocks are always given back.
        progress: show a tqdm bar over generated tokens.
        stop_at_eos: end a sequence when it samples eos (False: always max_new_tokens, e.g. to time an
            untrained model, which samples eos at random).
    Returns:
        str (list[str] for a batch), or (texts, traces) with return_trace, or a GenerationStream.
    """
    batched, texts = _check_prompt(prompt)
    if model is None:
        model = default_model()
    elif isinstance(model, str):
        model = load(model)
    elif not isinstance(model, MiniDSA):
        raise TypeError(f"model must be a MiniDSA, a config name/path or None, got {type(model).__name__}")
    _check_int("max_new_tokens", max_new_tokens)
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature = {temperature!r} must be a finite number >= 0 (0 = greedy)")
    if not _is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p!r} must be in (0, 1] (1 disables nucleus sampling)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if cache is not None and not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache (model.new_cache()), got {type(cache).__name__}")
    ctx = model.config.max_seq_len
    ids, features = _encode_prompts(model, texts, images, batched)
    for i, p in enumerate(ids):
        where = f"prompt[{i}]" if batched else "prompt"
        if len(p) > ctx:
            raise ValueError(f"{where} is {len(p)} tokens (bos included), longer than the model's context "
                             f"max_seq_len = {ctx}; shorten it")
        if len(p) + max_new_tokens > ctx:
            raise ValueError(f"{where} is {len(p)} tokens and max_new_tokens = {max_new_tokens}: together more than "
                             f"the context max_seq_len = {ctx}; use max_new_tokens <= {ctx - len(p)}")
    base = seed if seed is not None else int.from_bytes(os.urandom(6), "little")
    req = _Request(max_new_tokens, float(temperature), float(top_p), [base + i for i in range(len(ids))],
                   return_trace, progress, bool(stop_at_eos))
    run = GenerationStream(model, ids, req, cache if cache is not None else model.default_cache(), batched, features)
    if stream:
        return run
    for _ in run:
        pass
    out = run.texts if batched else run.texts[0]
    return (out, run.trace) if return_trace else out


def _encode_prompts(model: MiniDSA, texts: list[str], images, batched: bool):
    """Token ids per prompt (bos + bytes, <|media_pad|> expanded) and the image features per prompt."""
    tok = model.tokenizer
    if images is None:  # plain text: special-token strings stay literal text
        return [tok.encode(t) for t in texts], None
    per_prompt = images if batched else [images]
    if not isinstance(images, (list, tuple)) or (batched and (
            len(images) != len(texts) or not all(isinstance(x, (list, tuple)) for x in images))):
        want = "one list of images per prompt" if batched else "a list of images"
        raise TypeError(f"images must be {want}, got {type(images).__name__}"
                        + (f" of length {len(images)}" if isinstance(images, (list, tuple)) else ""))
    all_ids, all_feats = [], []
    for i, (text, imgs) in enumerate(zip(texts, per_prompt)):
        where = f"prompt[{i}]" if batched else "prompt"
        ids = tok.encode(text, allow_special=True)
        n_pad = ids.count(tok.media_pad_id)
        if n_pad == 0 and imgs:  # default placement: every image before the text
            marker = tok.encode(IMAGE_MARKER, add_bos=False, allow_special=True)
            ids = ids[:1] + marker * len(imgs) + ids[1:]
            n_pad = len(imgs)
        if n_pad != len(imgs):
            raise ValueError(f"{where} has {n_pad} <|media_pad|> placeholder(s) but {len(imgs)} image(s) were given; "
                             f"use one placeholder per image (or none, to put all images before the text)")
        prepared = [preprocess(im, model.config, name=f"images[{j}]" if not batched else f"images[{i}][{j}]")
                    for j, im in enumerate(imgs)]
        expanded, k = [], 0
        for t in ids:
            if t == tok.media_pad_id:
                expanded += [t] * prepared[k].num_tokens
                k += 1
            else:
                expanded.append(t)
        with torch.inference_mode():
            all_feats.append(model.encode_images(prepared))
        all_ids.append(expanded)
    return all_ids, all_feats


def _check_prompt(prompt) -> tuple[bool, list[str]]:
    if isinstance(prompt, str):
        return False, [prompt]
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError("prompt is an empty list; pass at least one string (an empty string starts from bos)")
        for i, p in enumerate(prompt):
            if not isinstance(p, str):
                raise TypeError(f"prompt[{i}] is a {type(p).__name__}; every prompt in a batch must be a str")
        return True, list(prompt)
    raise TypeError(f"prompt must be a str or a list of str, got {type(prompt).__name__}")


def _check_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {v!r}")
    if v < 1:
        raise ValueError(f"{name} = {v} must be >= 1")


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
