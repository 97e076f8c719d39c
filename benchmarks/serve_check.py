"""A fresh ``python -m minidsa serve`` driven by the ``openai`` client, as a user starts and calls it, against
an engine of the same settings (CUDA graphs included) of a model loaded here:

    PYTHONPATH=. python benchmarks/serve_check.py --checkpoint small --device cuda --backend triton

Three requests, one PASS/FAIL line each, exit 1 on any failure; each served text must equal the text of the
engine of the same settings here, and on the model's fp32 twin the engine with graphs must give the eager
engine's tokens, or part from them at a near-tie, as the doctor judges (below fp32 a prefill replayed from a
graph rounds differently and flips DSA keys and routed experts at near-ties: acceptance/end_to_end.py):
- a greedy completion;
- a streamed chat completion (the concatenated deltas);
- a chat with an image (a drawn green triangle as a data URL).
The server is a separate process, so nothing this process has run warms it up.
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import time

from PIL import Image

import minidsa
from minidsa.acceptance.end_to_end import drawn_image, graphs_against_eager, serve_process
from minidsa.server.chat import render

PASS_KEY = ("the river runs past old town where people walk slowly The pass key of kqz is 40271. "
            "birds sing of morning light on hills far away and the sky is blue\nQ: pass key of kqz?\nA: ")
MAX_TOKENS = 16


def _data_url(image) -> str:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _judge(got: str, mine: str, parted: str | None) -> tuple[bool, str]:
    """The served text against this process's engine of the same settings (equal), and on the fp32 twin the
    graphed engine against the eager one (``parted``: None, or a parting that must be a near-tie)."""
    if got != mine:
        return False, f"this process's engine (same settings) answered {mine!r}"
    return parted is None or parted.startswith("near-tie"), f"fp32 twin, graphs against eager: {parted or 'equal'}"


_START = time.perf_counter()


def _progress(what: str) -> None:
    """A line on stderr with the seconds since start: a run cut off by a time limit shows how far it got."""
    print(f"serve_check: {what} ({time.perf_counter() - _START:.1f} s)", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="default", help="what `serve --checkpoint` gets (default: default)")
    ap.add_argument("--device", default="cuda", help="torch device of both processes (default: cuda)")
    ap.add_argument("--backend", default="triton", choices=("torch", "triton", "gluon", "auto"), help="(default: triton)")
    args = ap.parse_args()
    import openai  # the client users call the service with (the test extra)

    model = minidsa.load(args.checkpoint, progress=False, device=args.device).set_backend(args.backend)
    same = minidsa.Engine(model, max_num_seqs=2)  # CUDA graphs on a GPU, as `serve` runs
    _progress("model loaded, this process's engine ready")
    greedy = minidsa.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    chat = [{"role": "user", "content": "pass key of kqz?"}]
    image_chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(drawn_image())}},
                                               {"type": "text", "text": "colour and shape?"}]}]
    failed = 0
    with serve_process(args.checkpoint, args.backend, args.device) as url:
        _progress(f"server answering at {url}")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)
        name = client.models.list().data[0].id
        cases = []
        got = client.completions.create(model=name, prompt=PASS_KEY, max_tokens=MAX_TOKENS, temperature=0)
        cases.append(("completion", PASS_KEY, [], got.choices[0].text))
        prompt, images = render(chat)
        stream = client.chat.completions.create(model=name, messages=chat, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True)
        cases.append(("streamed chat", prompt, images, "".join(c.choices[0].delta.content or "" for c in stream
                                                                 if c.choices)))
        prompt, images = render(image_chat)
        got = client.chat.completions.create(model=name, messages=image_chat, max_tokens=MAX_TOKENS, temperature=0)
        cases.append(("image chat", prompt, images, got.choices[0].message.content))
        _progress("three requests served")
    parted = graphs_against_eager(model, [c[1] for c in cases], greedy, [c[2] for c in cases])  # one fp32 twin
    _progress("fp32 twin: graphs against eager compared")
    for (what, prompt, images, text), how in zip(cases, parted):
        mine = same.generate([prompt], greedy, images=[images] if images else None, progress=False)[0]
        ok, why = _judge(text, mine.text, how)
        failed += not ok
        print(f"[{'PASS' if ok else 'FAIL'}] serve {args.checkpoint} {what}: served {text!r} ({why})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
