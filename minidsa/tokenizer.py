"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then the special tokens.

Bytes make every string encodable with no vocabulary file and no unknown token, which is what a
model that must run anywhere, untrained, wants. The special tokens carry the names the real model
uses for its media placeholders, so prompts written for it keep their shape here.
"""

from __future__ import annotations

import codecs
from typing import Iterable

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
)

# How one image is written into a prompt (the Kimi-VL chat form); the <|media_pad|> is replaced by the
# image's tokens. generate(..., images=[...]) inserts one per image before the text when the prompt has none.
IMAGE_MARKER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
VIDEO_MARKER = "<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"  # a video item in a prompt


class ByteTokenizer:
    """encode(str) -> list[int] and decode(list[int]) -> str, exact for any UTF-8 text."""

    num_bytes = 256

    def __init__(self) -> None:
        self.special_to_id = {tok: self.num_bytes + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.id_to_special = {i: tok for tok, i in self.special_to_id.items()}
        self.bos_id = self.special_to_id["<|bos|>"]
        self.eos_id = self.special_to_id["<|eos|>"]
        self.pad_id = self.special_to_id["<|pad|>"]
        self.media_begin_id = self.special_to_id["<|media_begin|>"]
        self.media_content_id = self.special_to_id["<|media_content|>"]
        self.media_end_id = self.special_to_id["<|media_end|>"]
        self.media_pad_id = self.special_to_id["<|media_pad|>"]

    @property
    def vocab_size(self) -> int:
        return self.num_bytes + len(SPECIAL_TOKENS)

    def encode(self, text: str, *, add_bos: bool = True, allow_special: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` (prefixed by bos). With ``allow_special`` the literal strings of
        SPECIAL_TOKENS become their ids; otherwise they are ordinary bytes, so encode/decode
        round-trips every string."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = [self.bos_id] if add_bos else []
        if not allow_special:
            return ids + list(_utf8(text))
        pos = 0
        while pos < len(text):
            nxt = min(((text.find(tok, pos), tok) for tok in SPECIAL_TOKENS if text.find(tok, pos) >= 0),
                      default=None)
            if nxt is None:
                ids += _utf8(text[pos:])
                break
            start, tok = nxt
            ids += _utf8(text[pos:start])
            ids.append(self.special_to_id[tok])
            pos = start + len(tok)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 (a model can emit any byte) becomes U+FFFD."""
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < self.num_bytes:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if i in self.id_to_special:
                if not skip_special:
                    out.append(self.id_to_special[i])
            elif not 0 <= i:
                raise ValueError(f"token id {i} is negative")
            # ids past the tokenizer (vocab padding) decode to nothing
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns ids into text pieces one token at a time, holding back an incomplete UTF-8 character."""

    def __init__(self, tok: ByteTokenizer) -> None:
        self.tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if 0 <= token_id < ByteTokenizer.num_bytes:
            return self._dec.decode(bytes([token_id]))
        return self._dec.decode(b"", final=True)  # a special token ends any pending character

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode for UTF-8 ({e.reason} at index {e.start}); "
                         f"remove lone surrogates, e.g. text.encode('utf-8', 'replace').decode()") from None
