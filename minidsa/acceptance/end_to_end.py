"""Rungs 5 to 7, through the engine and the service: batched requests, multimodal requests, the server.

Rung 5 runs prompts of different lengths as one batch and each alone, through one engine (prefix
caching off, so that batching is the only difference), and asks for the same greedy tokens. Below fp32
the alone runs record their DSA selections and routed experts and the batch replays them (held.py), on
eager steps, since a CUDA graph replay runs no Python to hold them with.
Rung 6 sends an image request and a video request through the engine and checks every greedy token
against one full forward over the prompt's embeddings (vision tower included) and the output.
Rung 5 also runs the engine's decode steps as CUDA graph replays and checks each against the same
padded step run eagerly on the same cache just before it (on the CPU, the padded step a graph would
replay against the unpadded eager step): a graph that recorded something not ready, or memory that
moved since, gives other numbers than the eager step.
Rung 7 starts ``python -m minidsa serve`` as a fresh process on the model's device and backend, as a user
does, and sends one plain and one streamed completion over real HTTP (urllib), which must return the
text an engine of the same settings computes in this process (its CUDA graphs included: a fresh process
must compute what a warmed-up one does); ``/metrics`` must count them. An in-process server would share
this process's state, which the earlier rungs have warmed up. That the graphs compute what the eager steps
do is checked on an fp32 twin of the model (the same weights, widened exactly): its graphed engine's tokens
must equal its eager engine's or part only at a near-tie. Below fp32 a prefill replayed from a graph (rows
padded, the sparse prefill's absorbed form) rounds differently from the eager step, which flips DSA keys and
routed experts at near-ties, and a graph replay runs no Python to hold them with; a random-weight model has
many such ties, and its tokens then part anywhere.

Greedy tokens from two paths may part where the two best logits nearly tie: rounding decides which wins,
and everything after differs. Such a parting is accepted when the two tokens' logits in a full forward
are within the logits tolerance of each other, and reported; any other parting fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from ..model.minidsa import MiniDSA
from ..serving.cuda_graphs import DecodeGraphs, padded_decode_context, run_padded
from ..serving.engine import Engine
from ..serving.params import SamplingParams
from ..serving.requests import encode_prompts
from ..tokenizer import IMAGE_MARKER, VIDEO_MARKER
from .held import HeldChoices
from .layers import logits_tolerance

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
    trace = None
    if held is not None:
        held.key_of, trace = (lambda sid: key), held.trace()
    with torch.inference_mode(), held.replaying() if held is not None else contextlib.nullcontext():
        logits = model(inputs_embeds=embeds_of(ids + a[:j]), trace=trace)[0, -1].double()
    gap = ((logits[a[j]] - logits[b[j]]).abs() / logits.abs().max()).item()
    kind = "near-tie" if gap <= tol else "not a tie"
    return f"{kind}: tokens {a[j]} and {b[j]} at output position {j}, logits {gap:.1e} of the scale apart"


def _text_embeds(model: MiniDSA):
    return lambda ids: model.language_model.model.embed_tokens(torch.tensor([ids], device=model.device))


def _failed(outputs) -> str | None:
    """Why a gate cannot compare these outputs: a request that did not finish by length or stop."""
    bad = [o for o in outputs if o.finish_reason not in ("length", "stop")]
    return None if not bad else f"a request finished with {bad[0].finish_reason!r}: {bad[0].error or 'no reason'}"


def check_batch(model: MiniDSA, tol: float, hold: bool) -> tuple[bool, list[str]]:
    """(ok, a line per row): each row of a batch against the same prompt alone. With ``hold``, the alone runs
    record their choices and the batch replays them (eager steps: a graph replay runs no Python)."""
    held = HeldChoices() if hold else None
    engine = Engine(model, max_num_seqs=4, enable_prefix_caching=False, cuda_graphs="off" if hold else "auto",
                    held_choices=held)
    if hold:  # each sequence's record is its prompt's, however the engine numbers the sequences
        held.key_of = lambda sid: next(r.prompt for r in engine.requests.values() if r.sid == sid)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = prompts(model)
    with held.recording() if hold else contextlib.nullcontext():
        alone = [engine.generate([text], params, progress=False)[0] for text in texts]
    with held.replaying() if hold else contextlib.nullcontext():
        batch = engine.generate(texts, params, progress=False)
    if why := _failed(alone + batch):
        return False, [why]
    ok, lines = True, []
    for text, row, one in zip(texts, batch, alone):
        why = parting(model, _text_embeds(model), row.prompt_token_ids, row.token_ids, one.token_ids, tol, held, text)
        ok &= why is None or why.startswith("near-tie")
        lines.append(f"{len(row.prompt_token_ids):4d}-token prompt: {'same tokens' if why is None else why}")
    return ok, lines


def check_media(model: MiniDSA, tol: float, hold: bool) -> tuple[bool, list[str]]:
    """(ok, a line per request): an image and a two-frame video, greedy through the engine, each token
    against the full forward over the same embeddings (with ``hold``, on the engine run's choices)."""
    held = HeldChoices() if hold else None
    engine = Engine(model, max_num_seqs=2, enable_prefix_caching=False, cuda_graphs="off" if hold else "auto",
                    held_choices=held)
    params = SamplingParams(temperature=0, max_tokens=MEDIA_TOKENS)
    frame = drawn_image()
    cases = {"image": (f"{IMAGE_MARKER}\nQ: colour and shape?\nA: ", [frame], None),
             "video": (f"{VIDEO_MARKER}\nQ: colour and shape?\nA: ", None, [[frame, frame[:, ::-1].copy()]])}
    ok, lines = True, []
    for kind, (text, images, videos) in cases.items():
        ids, feats = encode_prompts(model, [text], [images] if images else None, True, [videos] if videos else None)
        if hold:
            held.key_of = lambda sid, kind=kind: kind
        with held.recording() if hold else contextlib.nullcontext():
            req = engine.enqueue(text, ids[0], feats[0], params)
            while not req.finished:
                engine.step()
        if req.finish_reason not in ("length", "stop"):
            return False, [f"{kind}: the request finished with {req.finish_reason!r}: {req.error or 'no reason'}"]
        out = list(req.output_ids)

        def embeds_of(seq, feats=feats[0]):
            return model.embed(torch.tensor([seq], device=model.device), feats)
        with torch.inference_mode(), held.replaying() if hold else contextlib.nullcontext():
            full = model(inputs_embeds=embeds_of(ids[0] + out[:-1]), trace=held.trace() if hold else None)
            full = full[0, len(ids[0]) - 1:].argmax(-1).tolist()
        why = parting(model, embeds_of, ids[0], out, full, tol, held, kind)
        ok &= why is None or why.startswith("near-tie")
        lines.append(f"{kind} ({len(ids[0])} prompt tokens): {req.text!r}; "
                     f"{'every token the full forward argmax' if why is None else why}")
    return ok, lines


def check_graphs(model: MiniDSA, tol: float) -> tuple[bool, list[str]]:
    """(ok, lines): a batch through an engine whose decode steps replay CUDA graphs (eager padded steps on a
    CPU), each step against the eager step on the same cache. Relative logit differences within ``tol``."""
    engine = Engine(model, max_num_seqs=4, enable_prefix_caching=False)
    graphs = engine.graphs
    if graphs is None:  # no GPU: the padded steps a graph would replay, run as they are
        graphs = engine.graphs = DecodeGraphs(model, engine.cache, engine.scheduler.max_num_seqs, eager=True)
    replay, worst, steps = graphs.run, [0.0], [0]

    def compared(seq_ids: list[int], tokens: list[int]) -> torch.Tensor:
        B = len(seq_ids)
        rows = B if graphs.eager else next(b for b in graphs.buckets if b >= B)  # a GPU: the graph's own rows
        ids = torch.zeros(rows, 1, dtype=torch.long)
        ids[:B, 0] = torch.tensor(tokens)
        ctx = padded_decode_context(engine.cache, seq_ids, rows, graphs.max_blocks, model.device)
        want = run_padded(model, ids.to(model.device), ctx)[:B].float()  # nothing published: ctx is dropped
        got = replay(seq_ids, tokens)
        scale = want.abs().max().clamp_min(1e-30)
        gap = ((got - want).abs().max() / scale).item() if bool(torch.isfinite(got).all()) else float("inf")
        worst[0], steps[0] = max(worst[0], gap), steps[0] + 1
        return got
    graphs.run = compared
    try:
        outs = engine.generate(prompts(model), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               progress=False)
    finally:
        del graphs.run  # the instance attribute goes; the class's run shows through again
    done = all(o.finish_reason == "length" for o in outs)
    kind = "eager padded steps (no GPU)" if graphs.eager else "CUDA graph replays"
    ok = done and steps[0] > 0 and worst[0] <= tol
    return ok, [f"{steps[0]} decode steps as {kind} against the eager step on the same cache: worst logits "
                f"{worst[0]:.1e} of the scale; finish reasons {sorted({str(o.finish_reason) for o in outs})}"]


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.read()


STARTUP_SECONDS = 600  # a fresh process imports torch, builds or loads the model and captures its graphs


@contextlib.contextmanager
def serve_process(source, backend: str, device: str, max_num_seqs: int = 2):
    """``python -m minidsa serve`` of ``source`` in a fresh process on a free port -> its base URL; stopped
    (Ctrl-C, then killed) on exit. RuntimeError with the end of its stderr when it does not come up."""
    env = dict(os.environ)
    if backend == "triton" and device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    root = str(Path(__file__).resolve().parents[2])  # this copy of minidsa, also when run from a source tree
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "minidsa", "serve", "--checkpoint", str(source), "--device", device,
           "--backend", backend, "--port", "0", "--max-num-seqs", str(max_num_seqs)]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        try:
            url = None
            while url is None:
                try:
                    line = lines.get(timeout=STARTUP_SECONDS)
                except queue.Empty:
                    line = None
                if line is None:
                    err.seek(0)
                    raise RuntimeError(f"`{' '.join(cmd[1:])}` did not start serving (exit code {proc.poll()}): "
                                       f"{err.read()[-1500:].strip()}")
                found = re.search(r" at (http://\S+)/v1", line)
                url = found and found.group(1)
            yield url
        finally:
            proc.send_signal(2)  # SIGINT: serve stops on Ctrl-C
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def fp32_twin(model: MiniDSA) -> MiniDSA:
    """``model`` itself if it computes in fp32 or fp64; else an fp32 model of its config holding its weights
    (bf16 widens to fp32 exactly; the MXFP4 experts are copied as they are)."""
    if model.config.torch_dtype in (torch.float32, torch.float64):
        return model
    twin = MiniDSA(model.config.replace(dtype="float32"), device=model.device, init=False)
    twin.load_state_dict(model.state_dict())
    return twin.set_backend(model.backend)


def graphs_against_eager(model: MiniDSA, prompts_: list, params: SamplingParams, images=None) -> list[str | None]:
    """Per prompt (``images``: a list per prompt, as ``Engine.generate`` takes them): None when the engine with
    CUDA graphs (as ``serve`` runs) gives the eager engine's greedy tokens on the fp32 twin of ``model``, else
    where they part (``parting``, judged on the prompt's own embeddings: "near-tie ..." passes)."""
    twin = fp32_twin(model)
    runs = [Engine(twin, max_num_seqs=2, cuda_graphs=g).generate(prompts_, params, images=images, progress=False)
            for g in ("off", "auto")]
    feats = encode_prompts(twin, prompts_, images, True)[1]

    def embeds(f):
        return lambda seq: twin.embed(torch.tensor([seq], device=twin.device), f)
    return [parting(twin, embeds(f), list(w.prompt_token_ids), list(g.token_ids), list(w.token_ids),
                    logits_tolerance(torch.float32).value) for w, g, f in zip(*runs, feats)]


def check_service(model: MiniDSA, source, backend: str, device: str) -> tuple[bool, list[str]]:
    """(ok, lines): a fresh ``serve`` process answers one plain and one streamed completion with the text of an
    engine of the same settings here; that engine's graphs give its eager steps' tokens (fp32 twin, or a
    near-tie); its /metrics counts them."""
    text = prompts(model, 2)[1]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    same = Engine(model, max_num_seqs=2).generate([text], params, progress=False)[0]  # graphs as `serve` has them
    why = graphs_against_eager(model, [text], params)[0]
    body = {"prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        with serve_process(source, backend, device) as url:
            plain = json.loads(_post(url + "/v1/completions", body))["choices"][0]
            events = _post(url + "/v1/completions", body | {"stream": True}).decode().split("\n\n")
            with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                metrics = r.read().decode()
    except (RuntimeError, OSError, ValueError, KeyError) as e:  # it did not start, or answered an error
        detail = e.read().decode(errors="replace")[:500] if hasattr(e, "read") else ""
        return False, [f"the service failed: {type(e).__name__}: {' '.join(str(e).split())[:1500]} {detail}".rstrip()]
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: ") and e != "data: [DONE]"]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    generated = next((float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("minidsa:generation_tokens_total")), 0.0)
    ok = (plain["text"] == same.text and streamed == same.text and plain["finish_reason"] == same.finish_reason
          and generated >= 2 * len(same.token_ids) and (why is None or why.startswith("near-tie")))
    return ok, [f"fresh `python -m minidsa serve --checkpoint {source} --device {device} --backend {backend}`",
                f"plain {plain['text']!r} ({plain['finish_reason']}), streamed {streamed!r}, this process's engine "
                f"{same.text!r} ({same.finish_reason})",
                f"fp32 twin, the engine with graphs against the eager engine: {why or 'the same tokens'}",
                f"/metrics: {len(metrics.splitlines())} lines, minidsa:generation_tokens_total {generated:.0f}"]
