"""The HTTP service under load: N client threads stream completions through the server in a bounded loop, timed
from the client's side, and every answer is checked against the engine's own greedy output.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_server.py        # laptop, 32 clients, 256 requests
    PYTHONPATH=. python benchmarks/bench_server.py --dry-run                # shipped model, 4 clients, 8 requests

The server runs in this process on 127.0.0.1 (a free port) over the ``--config`` model (laptop: seeded random
weights), on one torch thread. Each client thread takes the next request, sends it with ``http.client`` (the
standard library, so the client adds no framework of its own) as a greedy stream with usage, and records:

- TTFT: from sending the request to the first event that carries text;
- TPOT: (last text event - first) / (output tokens - 1), the tokens from the closing usage event.

Prompts are seeded random letters. After the run the same prompts go through ``Engine.generate`` on the same
model (greedy, same max_tokens); an answer whose text or finish_reason differs is a mismatch. The
untrained model may sample eos early; the engine then says "stop" too, so the comparison holds. The last
line is PASS when there were no errors and no mismatches (tests/test_benchmarks.py runs ``--dry-run``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import threading
import time

import numpy as np
import torch

import minidsa
from minidsa import Engine, SamplingParams
from minidsa.server import start_server


def prompts(n: int, length: tuple[int, int], seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(*length))) for _ in range(n)]


def stream_one(port: int, prompt: str, max_tokens: int, timeout: float = 300.0) -> dict:
    """One streamed greedy completion: its text, finish_reason, output tokens and client-side timings."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        pieces, reason, tokens, first, last = [], None, 0, None, None
        for line in resp:  # server-sent events, one "data: ..." line each
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event, now = json.loads(line[6:]), time.perf_counter()
            if "error" in event:
                return {"error": event["error"]["message"]}
            if event["choices"]:
                first, last = first or now, now
                pieces.append(event["choices"][0]["text"])
                reason = event["choices"][0]["finish_reason"] or reason
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()
    if first is None:
        return {"error": "the stream carried no text event"}
    return {"text": "".join(pieces), "finish_reason": reason, "tokens": tokens, "ttft": first - t0,
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None}


def run_clients(port: int, texts: list[str], clients: int, max_tokens: int) -> tuple[list[dict], float]:
    """``clients`` threads, each taking the next prompt until none is left; (results in prompt order, seconds)."""
    results: list[dict | None] = [None] * len(texts)
    todo, lock = iter(range(len(texts))), threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            results[i] = stream_one(port, texts[i], max_tokens)

    pool = [threading.Thread(target=client, name=f"client-{k}") for k in range(clients)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return results, time.perf_counter() - start


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    return " / ".join(f"{v * 1e3:.0f}" for v in np.percentile(values, [50, 90, 99]))


def report(results: list[dict], expected, duration: float) -> tuple[str, bool]:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    mismatches = sum(1 for r, e in zip(results, expected) if "error" not in r and
                     (r["text"], r["finish_reason"]) != (e.text, e.finish_reason))
    tokens = sum(r["tokens"] for r in ok)
    rows = [("requests", f"{len(results)}"), ("duration", f"{duration:.1f} s"),
            ("requests/s", f"{len(results) / duration:.2f}"), ("output tokens/s", f"{tokens / duration:.1f}"),
            ("TTFT p50 / p90 / p99", percentiles([r["ttft"] for r in ok]) + " ms"),
            ("TPOT p50 / p90 / p99", percentiles([r["tpot"] for r in ok if r["tpot"] is not None]) + " ms"),
            ("errors", f"{len(errors)}" + (f" (first: {errors[0]})" if errors else "")),
            ("mismatches", f"{mismatches}")]
    table = "\n".join(f"| {k:<22} | {v:>24} |" for k, v in rows)
    return f"| {'metric':<22} | {'value':>24} |\n|{'-' * 24}|{'-' * 26}|\n" + table, not errors and not mismatches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="laptop", help="checkpoint or preset (default: laptop, seeded weights)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[8, 48], metavar=("MIN", "MAX"), help="in letters")
    p.add_argument("--max-num-seqs", type=int, default=None, help="(default: the config's max_sequences)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="the shipped model, 4 clients, 8 requests")
    args = p.parse_args()
    if args.dry_run:
        args.config, args.clients, args.requests = "default", 4, 8
    torch.set_num_threads(1)
    model = minidsa.load(args.config, progress=False)
    texts = prompts(args.requests, tuple(args.prompt_len), args.seed)
    engine_kw = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    with start_server(model, port=0, **engine_kw) as server:
        print(f"{args.config}: {args.clients} clients, {args.requests} streamed requests of {args.max_tokens} tokens "
              f"at most, server {server.url} (max_num_seqs {server.engine.max_num_seqs})")
        stream_one(server.port, "warm-up", 2)  # the first forward's one-off costs stay out of the figures
        results, duration = run_clients(server.port, texts, args.clients, args.max_tokens)
    expected = Engine(model, **engine_kw).generate(texts, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                                                   progress=False)
    table, passed = report(results, expected, duration)
    print(table)
    print("PASS" if passed else "FAIL")


if __name__ == "__main__":
    main()
