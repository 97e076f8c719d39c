"""Rungs 5 to 7, through the engine and the service: batched requests, multimodal requests, the server.

Rung 5 runs prompts of different lengths as one batch and each alone, through one engine (prefix
caching off, so that batching is the only difference), and asks for the same greedy tokens. Below fp32
the alone runs record their DSA selections and routed experts and the batch replays them (held.py), on
eager steps, since a CUDA graph replay runs no Python to hold them with.
Rung 6 sends an image request and a video request through the engine and checks every greedy token
against one full forward over the prompt's embeddings (vision tower included) and the output.
Rung 7 starts the server in-process on a free local port and sends one plain and one streamed
completion over real HTTP (urllib), which must return the engine's text; ``/metrics`` must count them.

Greedy tokens from two paths may part where the two best logits nearly tie: rounding decides which wins,
and everything after differs. Such a parting is accepted when the two tokens' logits in a full forward
are within the logits tolerance of each other, and reported; any other parting fails.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request

import numpy as np
import torch
from PIL import Image, ImageDraw

from ..model.minidsa import MiniDSA
from ..server import start_server
from ..serving.engine import Engine
from ..serving.params import SamplingParams
from ..serving.requests import encode_prompts
from ..tokenizer import IMAGE_MARKER, VIDEO_MARKER
from .held import HeldChoices

MAX_TOKENS = 8  # greedy tokens per request: enough to cross several decode steps, cheap on a CPU
MEDIA_TOKENS = 16  # an image answer is longer: "green triangle" and its eos


def prompts(model: MiniDSA, n: int = 4) -> list[str]:
    """Seeded letter prompts of different lengths (bos included: 13, 29, 45, ... tokens)."""
    rng = np.random.default_rng(3)
    cap = model.config.max_seq_len - MAX_TOKENS - 1
    return ["".join(rng.choice(list("abcdefghij klmnop"), size=min(12 + 16 * i, cap))) for i in range(n)]


def drawn_image(size: int = 56) -> np.ndarray:
    """A green triangle on a dark ground, as the shipped model saw in training (HxWx3 uint8)."""
    image = Image.new("RGB", (size, size), (20, 20, 30))
    ImageDraw.Draw(image).polygon([(size // 2, 12), (12, size - 12), (size - 12, size - 12)], fill=(40, 190, 60))
    return np.asarray(image)


def parting(model: MiniDSA, embeds_of, ids: list[int], a: list[int], b: list[int], tol: float,
            held: HeldChoices | None = None, key=None) -> str | None:
    """None when token lists ``a`` and ``b`` after prompt ``ids`` agree; else where they part and whether it is a
    near-tie ("near-tie ..."), or why not ("not a tie ..."). With ``held``, the full forward replays the
    choices recorded for sequence ``key``."""
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        return None if len(a) == len(b) else f"lengths {len(a)} and {len(b)} (one stopped early)"
    if held is not None:
        held.keys = lambda: [key]
    with torch.inference_mode(), held.replaying() if held is not None else contextlib.nullcontext():
        logits = model(inputs_embeds=embeds_of(ids + a[:j]))[0, -1].double()
    gap = ((logits[a[j]] - logits[b[j]]).abs() / logits.abs().max()).item()
    kind = "near-tie" if gap <= tol else "not a tie"
    return f"{kind}: tokens {a[j]} and {b[j]} at output position {j}, logits {gap:.1e} of the scale apart"


def _text_embeds(model: MiniDSA):
    return lambda ids: model.language_model.model.embed_tokens(torch.tensor([ids], device=model.device))


@contextlib.contextmanager
def rows_of(model: MiniDSA, engine: Engine, held: HeldChoices):
    """Name each batch row of the engine's forwards by its request's prompt, for ``held``."""
    current: list = [None]
    forward = model.forward

    def tracked(*args, seq_ids=None, **kw):
        current[0] = seq_ids
        return forward(*args, seq_ids=seq_ids, **kw)
    model.forward = tracked
    held.keys = lambda: [next(r.prompt for r in engine.requests.values() if r.sid == s) for s in current[0]]
    try:
        yield
    finally:
        del model.forward  # the instance attribute goes; the class's forward shows through again


def check_batch(model: MiniDSA, tol: float, hold: bool) -> tuple[bool, list[str]]:
    """(ok, a line per row): each row of a batch against the same prompt alone. With ``hold``, the alone runs
    record their choices and the batch replays them (eager steps: a graph replay runs no Python)."""
    engine = Engine(model, max_num_seqs=4, enable_prefix_caching=False, cuda_graphs="off" if hold else "auto")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = prompts(model)
    held = HeldChoices(model) if hold else None
    with rows_of(model, engine, held) if hold else contextlib.nullcontext():
        with held.recording() if hold else contextlib.nullcontext():
            alone = [engine.generate([text], params, progress=False)[0] for text in texts]
        with held.replaying() if hold else contextlib.nullcontext():
            batch = engine.generate(texts, params, progress=False)
    ok, lines = True, []
    for text, row, one in zip(texts, batch, alone):
        why = parting(model, _text_embeds(model), row.prompt_token_ids, row.token_ids, one.token_ids, tol, held, text)
        ok &= why is None or why.startswith("near-tie")
        lines.append(f"{len(row.prompt_token_ids):4d}-token prompt: {'same tokens' if why is None else why}")
    return ok, lines


def check_media(model: MiniDSA, tol: float, hold: bool) -> tuple[bool, list[str]]:
    """(ok, a line per request): an image and a two-frame video, greedy through the engine, each token
    against the full forward over the same embeddings (with ``hold``, on the engine run's choices)."""
    engine = Engine(model, max_num_seqs=2, enable_prefix_caching=False, cuda_graphs="off" if hold else "auto")
    params = SamplingParams(temperature=0, max_tokens=MEDIA_TOKENS)
    frame = drawn_image()
    cases = {"image": (f"{IMAGE_MARKER}\nQ: colour and shape?\nA: ", [frame], None),
             "video": (f"{VIDEO_MARKER}\nQ: colour and shape?\nA: ", None, [[frame, frame[:, ::-1].copy()]])}
    held = HeldChoices(model) if hold else None
    ok, lines = True, []
    for kind, (text, images, videos) in cases.items():
        ids, feats = encode_prompts(model, [text], [images] if images else None, True, [videos] if videos else None)
        if hold:
            held.keys = lambda kind=kind: [kind]
        with held.recording() if hold else contextlib.nullcontext():
            req = engine.enqueue(text, ids[0], feats[0], params)
            while not req.finished:
                engine.step()
        out = list(req.output_ids)

        def embeds_of(seq, feats=feats[0]):
            return model.embed(torch.tensor([seq], device=model.device), feats)
        with torch.inference_mode(), held.replaying() if hold else contextlib.nullcontext():
            full = model(inputs_embeds=embeds_of(ids[0] + out[:-1]))[0, len(ids[0]) - 1:].argmax(-1).tolist()
        why = parting(model, embeds_of, ids[0], out, full, tol, held, kind)
        ok &= why is None or why.startswith("near-tie")
        lines.append(f"{kind} ({len(ids[0])} prompt tokens): {req.text!r}; "
                     f"{'every token the full forward argmax' if why is None else why}")
    return ok, lines


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def check_service(model: MiniDSA) -> tuple[bool, list[str]]:
    """(ok, lines): one plain and one streamed completion over HTTP against the engine's text; /metrics."""
    text = prompts(model, 2)[1]
    want = Engine(model, max_num_seqs=2).generate([text], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                                   progress=False)[0].text
    body = {"prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0}
    with start_server(model, port=0, max_num_seqs=2) as server:
        plain = json.loads(_post(server.url + "/v1/completions", body))["choices"][0]["text"]
        events = _post(server.url + "/v1/completions", body | {"stream": True}).decode().split("\n\n")
        chunks = [json.loads(e[6:]) for e in events if e.startswith("data: ") and e != "data: [DONE]"]
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
    generated = next((float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("minidsa:generation_tokens_total")), 0.0)
    ok = plain == want and streamed == want and generated >= 2  # two requests, at least one token each
    return ok, [f"plain {plain!r}, streamed {streamed!r}, engine {want!r}",
                f"/metrics: {len(metrics.splitlines())} lines, minidsa:generation_tokens_total {generated:.0f}"]
