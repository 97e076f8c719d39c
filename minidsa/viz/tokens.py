"""Token helpers shared by every picture whose axis is tokens: a short printable label per token id, and
the positions that spell a piece of text.

The tokenizer is byte-level (one token per UTF-8 byte, then the special tokens), so a label is one
character: a space is drawn as "␣" and a newline as "⏎" so that they stay visible as tick labels, bytes
that are not printable ASCII (control bytes, the pieces of a multi-byte character) as "\\xNN", and the
special tokens by a short name ("bos", "eos", "img" for an image token, ...). ``find_span`` is how a
picture highlights, say, the pass key: by its text, not by hand-counted positions.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..model.trace import GenerationTrace
from ..tokenizer import ByteTokenizer

# special token -> its label; <|media_pad|> is what each image token is in a trace (the pad expanded)
SPECIAL_LABELS = {"<|bos|>": "bos", "<|eos|>": "eos", "<|pad|>": "pad", "<|media_begin|>": "img[",
                  "<|media_content|>": "imgc", "<|media_end|>": "]img", "<|media_pad|>": "img"}
VISIBLE = {ord(" "): "␣", ord("\n"): "⏎"}


def _ids(trace_or_ids) -> list[int]:
    """The token ids of a GenerationTrace, a list/tuple of ints or a 1-D tensor."""
    if isinstance(trace_or_ids, GenerationTrace):
        return [int(t) for t in trace_or_ids.token_ids]
    if isinstance(trace_or_ids, torch.Tensor):
        if trace_or_ids.dim() != 1:
            raise ValueError(f"token ids must be 1-D, got a tensor of shape {tuple(trace_or_ids.shape)}")
        return [int(t) for t in trace_or_ids.tolist()]
    if isinstance(trace_or_ids, str):
        raise TypeError("pass token ids or a GenerationTrace, not a str (encode it first)")
    return [int(t) for t in trace_or_ids]


def token_label(token_id: int) -> str:
    """One token id -> its label (see the module doc); ids past the tokenizer as "#<id>"."""
    token_id = int(token_id)
    if 0 <= token_id < ByteTokenizer.num_bytes:
        if token_id in VISIBLE:
            return VISIBLE[token_id]
        return chr(token_id) if 33 <= token_id <= 126 else f"\\x{token_id:02x}"
    special = ByteTokenizer().id_to_special.get(token_id)
    return SPECIAL_LABELS.get(special, f"#{token_id}")


def token_labels(token_ids: Iterable[int] | GenerationTrace) -> list[str]:
    """One printable label per byte-level token id (a GenerationTrace gives its ``token_ids``)."""
    return [token_label(t) for t in _ids(token_ids)]


def find_span(trace_or_ids, text: str) -> range:
    """The token positions spelling ``text`` (its UTF-8 bytes; first occurrence) in a trace's token ids or a
    list of ids. ValueError naming the text when it does not occur."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"text must be a non-empty str, got {text!r}")
    ids = _ids(trace_or_ids)
    pattern = list(text.encode("utf-8"))
    n = len(pattern)
    for start in range(len(ids) - n + 1):
        if ids[start: start + n] == pattern:
            return range(start, start + n)
    raise ValueError(f"text {text!r} does not occur in the {len(ids)} token ids")
