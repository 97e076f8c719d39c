"""Chat messages -> one prompt and its images, in the shipped model's training format.

The template, message by message in order:

- ``system`` (or ``developer``): its text + "\\n";
- ``user``: each image part as ``IMAGE_MARKER + "\\n"`` (images first, in order), then
  ``"Q: " + its text parts joined by "\\n" + "\\nA: "``;
- ``assistant``: its text + "\\n".

So a user message [image, "colour and shape?"] is ``f"{IMAGE_MARKER}\\nQ: colour and shape?\\nA: "``, the
question form the model was trained on (``minidsa.generate(question, images=[...])`` in the README).

``content`` is a string or a list of parts, ``{"type": "text", "text": ...}`` and
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``. Images come inline as data
URLs only: the server fetches nothing (it may run where there is no network, and fetching what a request
names is a way to make a server reach hosts its callers cannot). An image is decoded with Pillow into the
H x W x 3 uint8 array the engine takes.
"""

from __future__ import annotations

import io
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import numpy as np
from PIL import Image

from ..model.minidsa import MiniDSA
from ..serving.requests import Prompt, prepare_prompts
from ..tokenizer import IMAGE_MARKER, SPECIAL_TOKENS
from .protocol import invalid

ROLES = ("system", "developer", "user", "assistant")


def render(messages) -> tuple[str, list[np.ndarray]]:
    """(prompt, images) of a chat request's ``messages``; a 400 naming the message and part at fault."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
    prompt, images = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise invalid(where, f"{where} must be an object with a role in {ROLES}, got "
                                 f"{str(m)[:60] if not isinstance(m, dict) else repr(m.get('role'))}")
        texts, pictures = _parts(m.get("content"), where, m["role"])
        _no_special(texts, where)
        if m["role"] == "user":
            images += pictures
            prompt.append("".join(IMAGE_MARKER + "\n" for _ in pictures) + "Q: " + "\n".join(texts) + "\nA: ")
        else:
            prompt.append("\n".join(texts) + "\n")
    return "".join(prompt), images


def _no_special(texts: list[str], where: str) -> None:
    """A prompt with images is encoded with its special-token strings read as tokens (that is how the image
    markers become tokens), so a message's own text must not hold one: a literal "<|media_pad|>" would take
    an image's place and "<|eos|>" would end the prompt."""
    for t in texts:
        found = next((tok for tok in SPECIAL_TOKENS if tok in t), None)
        if found is not None:
            raise invalid(f"{where}.content", f"{where}.content holds the special token string {found!r}, which a "
                                              f"chat prompt reserves for the template and images; remove it")


def _parts(content, where: str, role: str) -> tuple[list[str], list[np.ndarray]]:
    """The text parts and decoded images of one message's content."""
    if content is None and role == "assistant":  # an assistant turn that only called tools
        return [], []
    if isinstance(content, str):
        return [content], []
    if not isinstance(content, list):
        raise invalid(f"{where}.content", f"{where}.content must be a string or a list of parts")
    texts, images = [], []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url" and role == "user":
            url = part.get("image_url")
            images.append(decode_image(url.get("url") if isinstance(url, dict) else url, f"{at}.image_url"))
        elif kind == "image_url":
            raise invalid(at, f"{at} is an image in the {role} message; images go in user messages")
        else:
            raise invalid(at, f"{at} must be {{\"type\": \"text\", \"text\": str}} or "
                              f"{{\"type\": \"image_url\", \"image_url\": {{\"url\": data URL}}}}, got {str(part)[:60]}")
    return texts, images


def decode_image(url, where: str) -> np.ndarray:
    """A data URL (``data:image/png;base64,...``) -> H x W x 3 uint8; any other URL is refused."""
    if not isinstance(url, str):
        raise invalid(where, f"{where} must hold a url string, got {type(url).__name__}")
    try:
        scheme = urlsplit(url).scheme
    except ValueError as e:  # e.g. an unbalanced [ in the host
        raise invalid(where, f"{where} is not a URL ({e}); send data:image/png;base64,<the file in base64>") from None
    if scheme != "data":
        raise invalid(where, f"{where} is a {scheme or 'relative'} URL ({url[:40]!r}); this server fetches nothing: "
                             f"send the image inline as a data URL, data:image/png;base64,<the file in base64>")
    try:  # urllib's data-URL handler: parses the media type and decodes base64; it opens no connection
        with urllib.request.DataHandler().data_open(urllib.request.Request(url)) as r:
            raw = r.read()
    except (ValueError, urllib.error.URLError) as e:  # binascii.Error is a ValueError
        raise invalid(where, f"{where} is not a well-formed data URL ({e}); send "
                             f"data:image/png;base64,<the file in base64>") from None
    try:
        with Image.open(io.BytesIO(raw)) as im:
            return np.asarray(im.convert("RGB"))
    except Image.DecompressionBombError as e:
        raise invalid(where, f"{where} is too large to decode safely ({e}); send a smaller image") from None
    except (ValueError, OSError):  # UnidentifiedImageError is an OSError
        raise invalid(where, f"{where} holds {len(raw)} bytes that are not an image Pillow can read; send a "
                             f"PNG or JPEG file as data:image/png;base64,<the file in base64>") from None


def prepare(model: MiniDSA, prompt: str, images: list[np.ndarray], field: str = "messages") -> Prompt:
    """The prompt as the engine will hold it, encoded once: ``len(.ids)`` counts bos and each image's tokens.
    A bad image or placeholder is a 400 naming ``field``."""
    try:
        return prepare_prompts(model, [prompt], images or None, False)[0]
    except (ValueError, TypeError) as e:
        raise invalid(field, " ".join(str(e).split())) from None
