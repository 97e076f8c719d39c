"""Seeded synthetic tasks, made on the fly (no downloads): the data the shipped model is trained and
evaluated on. Every sample is a function of (split, seed, index), so a run is reproducible and the
evaluation split never shares a random stream with the training split.

Pass-key retrieval (the prompt a user types, then the answer the model should give):

    <filler words> The pass key of kqz is 40271. <filler words ...>
    Q: pass key of kqz?
    A: 40271

The one passage that answers the question sits in the first quarter of the context, so with top-k far
below the context length the indexer must find it. ``num_distractors`` adds passages with other names
(and keys) anywhere in the filler: the question's name says which one counts.

Colour and shape of a drawn object (one image, prompt and answer):

    <|media_begin|>image<|media_content|><|media_pad|><|media_end|>
    Q: colour and shape?
    A: red circle
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw

from ..config import ModelConfig
from ..model.vision import PreparedImage, preprocess
from ..tokenizer import ByteTokenizer

SPLITS = {"train": 0, "eval": 1}  # the first word of every random stream: the splits never share one
FILLER_WORDS = ("the", "grass", "is", "green", "sky", "blue", "and", "a", "river", "runs", "past", "old", "town",
                "where", "people", "walk", "slowly", "under", "tall", "trees", "while", "birds", "sing", "of",
                "morning", "light", "on", "hills", "far", "away", "there", "was", "quiet", "road", "to", "sea")
KEY_DIGITS = 5  # digits of a pass key: chance of guessing one is 1e-5
NAME_LETTERS = 3  # letters of the name that labels a pass key
COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
IMAGE_SIZE = 56  # pixels per side: 4 x 4 patches of 14, i.e. 4 text tokens after the 2 x 2 merge
IMAGE_PROMPT = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\nQ: colour and shape?\nA: "


@dataclass
class Sample:
    """One task instance: ``prompt`` is what a user writes, ``answer`` what the model should continue with."""

    prompt: str
    answer: str
    image: np.ndarray | None = None  # uint8 [H, W, 3] for the multimodal task
    passage_start: int = -1  # character offset of the answering passage in ``prompt`` (retrieval only)


def rng_for(split: str, seed: int, index: int) -> np.random.Generator:
    """The random stream of sample ``index`` of ``split`` under ``seed``."""
    if split not in SPLITS:
        raise ValueError(f"split = {split!r}; use one of {sorted(SPLITS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed = {seed!r} must be a non-negative int")
    return np.random.default_rng([SPLITS[split], seed, index])


def passkey_question(name: str) -> str:
    """The question that ends a retrieval prompt; the answer follows it directly."""
    return f"\nQ: pass key of {name}?\nA: "


def retrieval_sample(rng: np.random.Generator, length: int, num_distractors: int = 0) -> Sample:
    """A pass-key prompt of exactly ``length`` bytes (answer excluded; plain ASCII, one token per byte)."""
    names: list[str] = []  # a list, not a set: set order follows string hashing, which varies per process
    while len(names) < 1 + num_distractors:
        name = "".join(chr(97 + int(c)) for c in rng.integers(0, 26, NAME_LETTERS))
        names += [name] if name not in names else []
    name, *others = names
    key = "".join(str(int(d)) for d in rng.integers(0, 10, KEY_DIGITS))
    passage = f" The pass key of {name} is {key}. "
    question = passkey_question(name)
    distractors = [f" The pass key of {o} is {''.join(str(int(d)) for d in rng.integers(0, 10, KEY_DIGITS))}. "
                   for o in others]
    filler_len = length - len(passage) - len(question) - sum(map(len, distractors))
    if filler_len < 4:
        need = length - filler_len + 4 + KEY_DIGITS + 2  # + answer, bos and eos
        raise ValueError(f"a retrieval context of {length + KEY_DIGITS + 2} tokens cannot hold the passages and the "
                         f"question; use a context of at least {need} tokens")
    filler = _filler(rng, filler_len)
    at = int(rng.integers(0, max(1, filler_len // 4)))  # the answering passage: first quarter of the context
    cuts = sorted(int(c) for c in rng.integers(at, filler_len + 1, len(distractors)))
    pieces, prev = [filler[:at], passage], at
    for cut, d in zip(cuts, distractors):
        pieces += [filler[prev:cut], d]
        prev = cut
    pieces += [filler[prev:], question]
    return Sample("".join(pieces), key, passage_start=at)


def _filler(rng: np.random.Generator, n: int) -> str:
    """Exactly ``n`` characters of random filler sentences."""
    words: list[str] = []
    size = 0
    while size < n:
        w = FILLER_WORDS[int(rng.integers(len(FILLER_WORDS)))]
        words.append(w + ("." if rng.random() < 0.12 else ""))
        size += len(words[-1]) + 1
    return " ".join(words)[:n]


def shape_image(rng: np.random.Generator) -> tuple[np.ndarray, str, str]:
    """A uint8 [56, 56, 3] image of one filled shape in one colour on a dark noisy background -> (image,
    colour name, shape name)."""
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    background = tuple(int(c) for c in rng.integers(0, 60, 3))
    im = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), background)
    size = int(rng.integers(20, 40))
    x0, y0 = (int(c) for c in rng.integers(2, IMAGE_SIZE - size - 2, 2))
    box = (x0, y0, x0 + size, y0 + size)
    draw = ImageDraw.Draw(im)
    fill = tuple(int(np.clip(c + rng.integers(-25, 26), 0, 255)) for c in COLOURS[colour])
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + size // 2, y0), (x0, y0 + size), (x0 + size, y0 + size)], fill=fill)
    arr = np.asarray(im, dtype=np.int16) + rng.integers(-8, 9, (IMAGE_SIZE, IMAGE_SIZE, 3))
    return np.clip(arr, 0, 255).astype(np.uint8), colour, shape


def multimodal_sample(rng: np.random.Generator) -> Sample:
    image, colour, shape = shape_image(rng)
    return Sample(IMAGE_PROMPT, f"{colour} {shape}", image=image)


def samples(task: str, split: str, seed: int, start: int, count: int, context: int = 128,
            num_distractors: int = 0) -> list[Sample]:
    """Samples ``start .. start + count - 1`` of a task ("retrieval" or "multimodal"). A retrieval
    prompt plus its answer and the bos/eos tokens fill exactly ``context`` tokens."""
    if task == "retrieval":
        return [retrieval_sample(rng_for(split, seed, i), context - KEY_DIGITS - 2, num_distractors)
                for i in range(start, start + count)]
    if task == "multimodal":
        return [multimodal_sample(rng_for(split, seed, i)) for i in range(start, start + count)]
    raise ValueError(f"task = {task!r}; use 'retrieval' or 'multimodal'")


@dataclass
class TokenBatch:
    """Samples as model input: the prompt and answer tokens of each row, right-padded."""

    input_ids: torch.Tensor  # int64 [B, T]: bos, prompt (each <|media_pad|> expanded to its image's tokens), answer, eos
    labels: torch.Tensor  # int64 [B, T]: at position t the token t + 1 when it is answer or eos, else -100 (no loss)
    images: list[PreparedImage]  # one per multimodal row, in row order (empty for text tasks)


def encode(batch: list[Sample], cfg: ModelConfig) -> TokenBatch:
    """Token ids and answer labels of ``batch``; images are preprocessed for ``cfg``'s vision tower."""
    tok = ByteTokenizer()
    rows, targets, images = [], [], []
    for s in batch:
        ids = tok.encode(s.prompt, allow_special=s.image is not None)
        if s.image is not None:
            images.append(preprocess(s.image, cfg))
            at = ids.index(tok.media_pad_id)
            ids = ids[:at] + [tok.media_pad_id] * images[-1].num_tokens + ids[at + 1:]
        answer = tok.encode(s.answer, add_bos=False) + [tok.eos_id]
        rows.append(ids + answer)
        targets.append([-100] * (len(ids) - 1) + answer + [-100])
    T = max(map(len, rows))
    input_ids = torch.full((len(rows), T), tok.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    for i, (r, t) in enumerate(zip(rows, targets)):
        input_ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(t)] = torch.tensor(t)
    return TokenBatch(input_ids, labels, images)


def default_context(cfg: ModelConfig) -> int:
    """Retrieval context of a config: 16 x the indexer's top-k (so at most 1/16 of the keys are selected),
    capped by the model's max_seq_len."""
    return min(cfg.max_seq_len, 16 * cfg.indexer.topk)
