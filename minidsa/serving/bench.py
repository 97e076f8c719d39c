"""Offline serving benchmark: N seeded requests through the engine, the figures ``vllm bench serve`` prints,
and the same requests through a sequential ``generate()`` loop in the same run.

    python -m minidsa bench --config laptop --num-requests 32 --input-len 32 512 --output-len 16 128

The workload is nano-vllm's: input and output lengths drawn uniformly (seeded), prompts of random
letters, every request running to its output length (eos ignored). ``--shared-prefix N`` starts every
prompt with the same N tokens, primed by one untimed warm-up request (a system prompt already cached);
``--images K`` gives every prompt K seeded random images. All requests arrive at once, so TTFT includes
the time a request waits for a slot.

The report also gives the decode ceiling of the same model at the engine's mean decode batch: one static
decode step of that many sequences (of the workload's mean prompt length) replayed from a CUDA graph on a
GPU, run eagerly on the CPU, with no scheduling, sampling or host bookkeeping around it; and the engine's
decode-only steps (every row one token) against it, whole steps as the engine ran them.

Every request must end by reaching its output length (finish_reason "length"): eos is ignored and no
stop string is set, so "stop" is as wrong as "error" or "abort". ``failure(result)`` says how many did
not and why; the CLI then exits 1, so a broken run never reads as a slow one.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections import Counter

import numpy as np
import torch

from .. import ops
from ..cache import PagedKVCache
from ..model.minidsa import MiniDSA
from .cuda_graphs import decode_logits, padded_decode_context
from .engine import Engine
from .generation import generate
from .params import SamplingParams


def workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0,
             shared_prefix: int = 0, images: int = 0, image_size: int = 32) -> list[dict]:
    """The requests: {"prompt", "max_tokens", "images"} each; prompt lengths in tokens include bos and the
    shared prefix (an image's tokens come on top)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    prefix = "".join(rng.choice(letters) for _ in range(max(0, shared_prefix - 1)))
    out = []
    for _ in range(num_requests):
        n = rng.randint(*input_len)
        body = "".join(rng.choice(letters) for _ in range(max(1, n - 1 - len(prefix))))
        ims = [np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (image_size, image_size, 3),
                                                                  dtype=np.uint8) for _ in range(images)]
        out.append({"prompt": prefix + body, "max_tokens": rng.randint(*output_len), "images": ims or None})
    return out


def warmup_request(requests: list[dict], shared_prefix: int) -> dict | None:
    """The untimed request that primes the cache with the shared prefix (None without one)."""
    if not shared_prefix:
        return None
    return {"prompt": requests[0]["prompt"][: shared_prefix - 1] + " ", "images": None}


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "p99": float(np.percentile(values, 99))}


def run_engine(model: MiniDSA, requests: list[dict], warmup: dict | None = None, **engine_kw) -> dict:
    """Every request through one Engine; the vllm-bench-serve fields plus preemptions and hit rates."""
    up = time.perf_counter()  # what a user waits before the first request: graphs captured (and compiled)
    engine = Engine(model, **engine_kw)
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    if warmup is not None:
        engine.generate([warmup["prompt"]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                        images=[warmup["images"]], progress=False)
    startup = time.perf_counter() - up
    before = engine.stats()
    start = time.perf_counter()
    outs = engine.generate([r["prompt"] for r in requests], params, images=[r["images"] for r in requests],
                           progress=False)
    duration = time.perf_counter() - start
    s = engine.stats()
    queries = s["prefix_cache_queries"] - before["prefix_cache_queries"]
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.token_ids) for o in outs)
    ms = [o.metrics for o in outs if o.finish_reason == "length"]  # latencies of the requests that finished
    return {
        "successful_requests": sum(o.finish_reason == "length" for o in outs),
        "num_requests": len(outs), "failures": _failures(outs), "startup_s": startup,
        "duration_s": duration, "total_input_tokens": n_in, "total_generated_tokens": n_out,
        "request_throughput": len(outs) / duration, "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "ttft_ms": _stats([m.ttft * 1e3 for m in ms]), "tpot_ms": _stats([m.tpot * 1e3 for m in ms if m.tpot]),
        "itl_ms": _stats([x * 1e3 for m in ms for x in m.itl]), "e2e_ms": _stats([m.e2e * 1e3 for m in ms]),
        "num_preemptions": s["num_preemptions"] - before["num_preemptions"],
        "prefix_hit_rate_kv": (s["prefix_cache_hits_kv"] - before["prefix_cache_hits_kv"]) / max(1, queries),
        "prefix_hit_rate": (s["prefix_cache_hits"] - before["prefix_cache_hits"]) / max(1, queries),
        "num_blocks": engine.cache.layout.num_blocks, "cache_bound": s["memory"]["bound"],
        "decode_steps": s["decode_steps"] - before["decode_steps"],
        "decode_tokens_per_s": (s["decode_tokens"] - before["decode_tokens"]) / max(
            1e-9, s["decode_seconds"] - before["decode_seconds"]),
        "mean_decode_batch": (s["decode_tokens"] - before["decode_tokens"]) / max(
            1, s["decode_steps"] - before["decode_steps"]),
        "prefill_steps": s["prefill_steps"] - before["prefill_steps"],
        "prefill_seconds": s["prefill_seconds"] - before["prefill_seconds"],
        "prefill_replays": s["step_graph_replays"] - before["step_graph_replays"],
        "shapes_captured": s["step_graph_captures"] - before["step_graph_captures"],
        "capture_seconds": s["step_graph_capture_seconds"] - before["step_graph_capture_seconds"],
        "step_times": {how: (n - before["step_times"].get(how, (0, 0.0))[0],
                             t - before["step_times"].get(how, (0, 0.0))[1]) for how, (n, t) in s["step_times"].items()},
    }


def decode_ceiling(model: MiniDSA, batch: int, context: int, reps: int = 20) -> float:
    """Tokens/s of one static decode step of ``batch`` sequences holding ``context`` tokens each: the step
    captured once and replayed (CUDA), or run again on the same context (CPU); nothing else timed."""
    batch, context = max(1, batch), max(1, min(context, model.config.max_seq_len - 1))
    layout = model.cache_layout(batch * -(-(context + 1) // model.config.kv_block_size))
    cache = PagedKVCache(dataclasses.replace(layout, num_state_slots=batch), model.device)  # a slot per row
    sids = [cache.add_sequence() for _ in range(batch)]
    dev = model.device
    ids = torch.randint(1, model.tokenizer.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids.to(dev), cache=cache, seq_ids=sids)
        cache.reserve({s: context + 1 for s in sids})
        ctx = padded_decode_context(cache, sids, batch, -(-(context + 1) // cache.block_size), dev)
        tokens = torch.ones(batch, 1, dtype=torch.long, device=dev)
        with ops.use_backend(model.backend):
            step = lambda: decode_logits(model, tokens, ctx)
            step()
            if dev.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                step = graph.replay
                step()
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(reps):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
    return batch * reps / (time.perf_counter() - start)


def _failures(outs) -> dict[str, int]:
    """How many requests ended other than by reaching their length, by finish reason and error text."""
    return dict(Counter(f"{o.finish_reason}: {o.error}" if o.error else str(o.finish_reason)
                        for o in outs if o.finish_reason != "length").most_common())


def failure(result: dict, shown: int = 3) -> str | None:
    """None when every request reached its output length; else one paragraph: how many did not and why,
    the commonest reasons first (``shown`` of them)."""
    fails = result["failures"]
    if not fails:
        return None
    n = sum(fails.values())
    lines = [f"{n} of {result['num_requests']} requests did not finish normally (each should stop at its output "
             f"length, finish_reason 'length'); the figures above do not measure the engine:"]
    lines += [f"  {count} x {why}" for why, count in list(fails.items())[:shown]]
    if len(fails) > shown:
        lines.append(f"  ... and {len(fails) - shown} other reasons ({sum(list(fails.values())[shown:])} requests)")
    return "\n".join(lines)


def run_sequential(model: MiniDSA, requests: list[dict]) -> dict:
    """The same requests one after another through ``generate()`` (no engine): the baseline."""
    start = time.perf_counter()
    n_out = 0
    for r in requests:
        generate(r["prompt"], model, images=r["images"], max_new_tokens=r["max_tokens"], temperature=0,
                 stop_at_eos=False)
        n_out += r["max_tokens"]
    duration = time.perf_counter() - start
    return {"duration_s": duration, "output_throughput": n_out / duration}


def format_report(result: dict, title: str = "Serving Benchmark Result") -> str:
    """The engine's figures laid out as ``vllm bench serve`` prints them."""
    r = result
    lines = [f"{' ' + title + ' ':=^50}",
             f"{'Successful requests:':<40}{r['successful_requests']:>10}",
             f"{'Failed requests:':<40}{r['num_requests'] - r['successful_requests']:>10}",
             f"{'Benchmark duration (s):':<40}{r['duration_s']:>10.2f}",
             f"{'Total input tokens:':<40}{r['total_input_tokens']:>10}",
             f"{'Total generated tokens:':<40}{r['total_generated_tokens']:>10}",
             f"{'Request throughput (req/s):':<40}{r['request_throughput']:>10.2f}",
             f"{'Output token throughput (tok/s):':<40}{r['output_throughput']:>10.2f}",
             f"{'Total Token throughput (tok/s):':<40}{r['total_token_throughput']:>10.2f}"]
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                      ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        lines.append(f"{name:-^50}")
        lines += [f"{f'{label} {short} (ms):':<40}{r[key][k]:>10.2f}"
                  for label, k in (("Mean", "mean"), ("Median", "median"), ("P99", "p99"))]
    lines += [f"{'':-^50}",
              f"{'Preemptions:':<40}{r['num_preemptions']:>10}",
              f"{'Prefix cache hit rate, KV blocks:':<40}{r['prefix_hit_rate_kv']:>10.1%}",
              f"{'Prefix cache hit rate, used (KDA):':<40}{r['prefix_hit_rate']:>10.1%}",
              f"{'KV blocks (bound):':<40}{str(r['num_blocks']) + ' (' + r['cache_bound'] + ')':>10}",
              f"{'Engine start-up, warm-up included (s):':<40}{r['startup_s']:>10.2f}",
              f"{'Steps with prefill rows (s):':<40}{r['prefill_seconds']:>10.2f}",
              f"{'  of them, steps / graph replays:':<40}{str(r['prefill_steps']) + ' / ' + str(r['prefill_replays']):>10}",
              f"{'  shapes captured meanwhile:':<40}{r['shapes_captured']:>10}",
              f"{'  capturing them (s):':<40}{r['capture_seconds']:>10.2f}"]
    # the forwards' wall time by how they ran (scheduling, sampling and outputs are the rest of the duration)
    lines += [f"{f'Forwards, {how} (steps / s):':<40}{f'{n} / {t:.2f}':>10}"
              for how, (n, t) in sorted(r.get("step_times", {}).items()) if n]
    if "sequential" in r:
        seq = r["sequential"]
        lines += [f"{'Sequential generate() duration (s):':<40}{seq['duration_s']:>10.2f}",
                  f"{'Sequential output throughput (tok/s):':<40}{seq['output_throughput']:>10.2f}",
                  f"{'Engine / sequential throughput:':<40}{r['output_throughput'] / seq['output_throughput']:>9.2f}x"]
    if "decode_ceiling" in r:
        lines += [f"{'Decode-only steps (tok/s):':<40}{r['decode_tokens_per_s']:>10.2f}",
                  f"{'Decode ceiling, batch ' + str(round(r['mean_decode_batch'])) + ' (tok/s):':<40}"
                  f"{r['decode_ceiling']:>10.2f}",
                  f"{'Decode-only steps / ceiling:':<40}{r['decode_tokens_per_s'] / r['decode_ceiling']:>9.2f}x"]
    return "\n".join(lines + ["=" * 50])


def benchmark(model: MiniDSA, num_requests: int = 32, input_len: tuple[int, int] = (32, 512),
              output_len: tuple[int, int] = (16, 128), seed: int = 0, shared_prefix: int = 0, images: int = 0,
              sequential: bool = True, **engine_kw) -> dict:
    """``run_engine`` on the seeded workload, plus the sequential loop on the same requests (skipped when
    a request failed: there is nothing to compare then)."""
    requests = workload(num_requests, input_len, output_len, seed, shared_prefix, images)
    result = run_engine(model, requests, warmup_request(requests, shared_prefix), **engine_kw)
    if sequential and not result["failures"]:
        result["sequential"] = run_sequential(model, requests)
    return add_ceiling(model, result, input_len)


def add_ceiling(model: MiniDSA, result: dict, input_len: tuple[int, int]) -> dict:
    """``result`` with the decode ceiling at its mean decode batch and mean prompt length (when it has
    decode-only steps and no failed request)."""
    if result["decode_steps"] and not result["failures"]:
        result["decode_ceiling"] = decode_ceiling(model, round(result["mean_decode_batch"]), sum(input_len) // 2)
    return result
