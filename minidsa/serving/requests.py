"""Turning a generate() call into a checked request: arguments validated, prompts encoded (text, and
images through the vision tower), sequence lengths checked against the context, seeds fixed. ``Prompt`` is one
prompt encoded once, which a service checks and then hands to the engine as it is.

Every check runs before any cache block is taken, and names the bad value and the fix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..model.minidsa import MiniDSA
from ..model.vision import preprocess, preprocess_video
from ..tokenizer import IMAGE_MARKER, VIDEO_MARKER

MEDIA_PAD = "<|media_pad|>"  # the placeholder an image or video item replaces

SEED_END = 2**64  # torch.Generator.manual_seed takes seeds below this (negative ones wrap around)


@dataclass
class Request:
    """A checked generate() request: token ids per prompt, image features per prompt, sampling settings."""

    prompts: list[list[int]]  # bos + bytes per prompt, each <|media_pad|> expanded to its image's tokens
    image_features: list[list[torch.Tensor]]  # per prompt, one [num_tokens, d] tensor per image
    batched: bool  # the caller passed a list of prompts
    max_new_tokens: int
    temperature: float
    top_p: float
    seeds: list[int]  # row i samples with seed + i, so a row samples as it would alone
    trace: bool  # record a GenerationTrace per prompt
    progress: bool
    stop_at_eos: bool


def build_request(model: MiniDSA, prompt, images, max_new_tokens, temperature, top_p, seed, trace,
                  progress, stop_at_eos, videos=None) -> Request:
    """Check every argument of ``generate`` and encode the prompts; raise ValueError/TypeError naming the value."""
    batched, texts = check_prompt(prompt)
    check_positive_int("max_new_tokens", max_new_tokens)
    if not is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature = {temperature!r} must be a finite number >= 0 (0 = greedy)")
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p!r} must be in (0, 1] (1 disables nucleus sampling)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if seed is not None and not (0 <= seed and seed + len(texts) <= SEED_END):  # row i samples with seed + i
        raise ValueError(f"seed = {seed} is outside [0, 2**64 - {len(texts)}]: torch seeds are unsigned 64-bit "
                         f"and row i of the batch uses seed + i; pass a smaller non-negative seed")
    ids, features = encode_prompts(model, texts, images, batched, videos)
    for i, p in enumerate(ids):
        check_context(f"prompt[{i}]" if batched else "prompt", len(p), "max_new_tokens", max_new_tokens,
                      model.config.max_seq_len)
    base = seed if seed is not None else int.from_bytes(os.urandom(6), "little")
    return Request(ids, features, batched, max_new_tokens, float(temperature), float(top_p),
                   [base + i for i in range(len(ids))], bool(trace), progress, bool(stop_at_eos))


@dataclass
class Prompt:
    """One prompt ready for the engine, encoded once: its text, its ids (bos + bytes, each <|media_pad|> grown to
    its item's tokens, so ``len(ids)`` is what the context holds) and its images and videos preprocessed into
    patches (not yet through the vision tower: that is a forward, run where the model runs)."""

    text: str
    ids: list[int]
    media: list  # model.vision.preprocess / preprocess_video results, in placeholder order


def prepare_prompts(model: MiniDSA, texts: list[str], images, batched: bool, videos=None) -> list[Prompt]:
    """Each prompt's ids and preprocessed media, every placeholder checked. A prompt's placeholders take its
    images first, then its videos (each a list of 1 to 4 frames)."""
    tok = model.tokenizer
    if images is None and videos is None:  # plain text: other special-token strings stay literal text
        for i, text in enumerate(texts):
            _check_placeholders(text.count(MEDIA_PAD), 0, 0, f"prompt[{i}]" if batched else "prompt")
        return [Prompt(t, tok.encode(t), []) for t in texts]
    per_images = _per_prompt("images", images, texts, batched, "images")
    per_videos = _per_prompt("videos", videos, texts, batched, "videos (each a list of frames)")
    prompts = []
    for i, (text, imgs, vids) in enumerate(zip(texts, per_images, per_videos)):
        at = f"[{i}]" if batched else ""
        media = [preprocess(im, model.config, name=f"images{at}[{j}]") for j, im in enumerate(imgs)]
        media += [preprocess_video(v, model.config, name=f"videos{at}[{j}]") for j, v in enumerate(vids)]
        prompts.append(Prompt(text, _place_media(model, text, media, len(imgs), f"prompt{at}"), media))
    return prompts


def media_features(model: MiniDSA, prompt: Prompt) -> list[torch.Tensor]:
    """The prompt's images and videos through the vision tower: one [num_tokens, d] tensor per item."""
    if not prompt.media:
        return []
    with torch.inference_mode():
        return model.encode_images(prompt.media)


def encode_prompts(model: MiniDSA, texts: list[str], images, batched: bool, videos=None):
    """(ids per prompt, media features per prompt): ``prepare_prompts`` then the vision tower."""
    prompts = prepare_prompts(model, texts, images, batched, videos)
    return [p.ids for p in prompts], [media_features(model, p) for p in prompts]


def _per_prompt(what: str, items, texts: list[str], batched: bool, noun: str) -> list:
    """``items`` as one list per prompt ([] each when None); TypeError naming the expected form."""
    if items is None:
        return [[] for _ in texts]
    if not isinstance(items, (list, tuple)) or (batched and (
            len(items) != len(texts) or not all(isinstance(x, (list, tuple)) for x in items))):
        want = f"one list of {noun} per prompt" if batched else f"a list of {noun}"
        raise TypeError(f"{what} must be {want}, got {type(items).__name__}"
                        + (f" of length {len(items)}" if isinstance(items, (list, tuple)) else ""))
    return list(items) if batched else [items]


def _place_media(model: MiniDSA, text: str, prepared: list, num_images: int, where: str) -> list[int]:
    """One prompt's ids with each <|media_pad|> expanded to its item's token count (images, then videos).

    A prompt without placeholders gets every item before its text (IMAGE_MARKER per image, then
    VIDEO_MARKER per video); otherwise the placeholders must be exactly one per item, and a placeholder
    written as IMAGE_MARKER or VIDEO_MARKER must receive an item of that kind."""
    tok = model.tokenizer
    ids = tok.encode(text, allow_special=True)
    n_pad = ids.count(tok.media_pad_id)
    if n_pad == 0 and prepared:  # default placement: every item before the text
        markers = [IMAGE_MARKER] * num_images + [VIDEO_MARKER] * (len(prepared) - num_images)
        ids = ids[:1] + [t for m in markers for t in tok.encode(m, add_bos=False, allow_special=True)] + ids[1:]
        n_pad = len(prepared)
    _check_placeholders(n_pad, num_images, len(prepared) - num_images, where)
    _check_marker_kinds(tok, ids, num_images, where)
    expanded, k = [], 0
    for t in ids:
        if t == tok.media_pad_id:
            expanded += [t] * prepared[k].num_tokens
            k += 1
        else:
            expanded.append(t)
    return expanded


def _check_placeholders(n_pad: int, num_images: int, num_videos: int, where: str) -> None:
    """ValueError unless a prompt with ``n_pad`` placeholders gets one item per placeholder. A marker with
    no item would otherwise reach the model as its literal bytes and get a confident answer about an
    image nobody sent."""
    if n_pad == num_images + num_videos:
        return
    fix = ("pass one image per IMAGE_MARKER with images=[...] (videos=[...] for VIDEO_MARKER), or remove the "
           "marker" if num_images + num_videos == 0 else
           "use one placeholder per item (images first, then videos), or none to put them all before the text")
    raise ValueError(f"{where} has {n_pad} {MEDIA_PAD} placeholder(s) but {num_images} image(s) and {num_videos} "
                     f"video(s) were given; {fix}")


def _check_marker_kinds(tok, ids: list[int], num_images: int, where: str) -> None:
    """ValueError where a placeholder written as IMAGE_MARKER gets a video or one in VIDEO_MARKER an image
    (placeholders take the images first, then the videos)."""
    kinds = {kind: [tok.media_begin_id, *kind.encode(), tok.media_content_id] for kind in ("image", "video")}
    pads = [j for j, t in enumerate(ids) if t == tok.media_pad_id]
    for k, j in enumerate(pads):
        gets = "image" if k < num_images else "video"
        written = next((kind for kind, head in kinds.items() if ids[max(0, j - len(head)):j] == head), gets)
        if written != gets:
            item = f"images[{k}]" if gets == "image" else f"videos[{k - num_images}]"
            raise ValueError(f"{where}: placeholder {k} is written as a {written} marker but receives {item} "
                             f"(placeholders take the {num_images} image(s) first, then the videos); write every "
                             f"IMAGE_MARKER before the first VIDEO_MARKER")


class RequestError(ValueError):
    """A request argument that cannot be served, with the argument to fix as ``field`` ("prompt", "images",
    "max_tokens", ...): a service names it to its client without reading the message."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_context(where: str, prompt_len: int, name: str, max_new: int, ctx: int) -> None:
    """RequestError unless a prompt of ``prompt_len`` ids and ``max_new`` new tokens (the argument ``name``)
    fit the context ``ctx``; at least one new token must fit after the prompt. Its field: "prompt" or ``name``."""
    if prompt_len >= ctx:
        raise RequestError(f"{where} is {prompt_len} tokens (bos included) and leaves no room for a new token in "
                           f"the model's context max_seq_len = {ctx}; shorten it to at most {ctx - 1} tokens", "prompt")
    if prompt_len + max_new > ctx:
        raise RequestError(f"{where} is {prompt_len} tokens and {name} = {max_new}: together more than "
                           f"the context max_seq_len = {ctx}; use {name} <= {ctx - prompt_len}", name)


def check_prompt(prompt) -> tuple[bool, list[str]]:
    """(batched, prompts) for a str or a non-empty list of str."""
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


def check_positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {v!r}")
    if v < 1:
        raise ValueError(f"{name} = {v} must be >= 1")


def is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
