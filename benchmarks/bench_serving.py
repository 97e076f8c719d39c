"""The serving engine on a workload: throughput and latency against a sequential ``generate()`` loop, the
decode step replayed from CUDA graphs against the eager step, and allocated memory over a steady run.

    PYTHONPATH=. python benchmarks/bench_serving.py --config laptop                       # the CPU figures
    PYTHONPATH=. python benchmarks/bench_serving.py --config small --device cuda \\
        --num-requests 256 --input-len 100 1024 --output-len 100 512 --sequential-requests 8

``--sequential-requests N`` times the sequential loop on the first N requests only (on the GPU the whole
loop would take longer than the engine run by the ratio being measured) and compares output tokens/s.
``--graph-check`` replays one padded decode step from its graph and compares it with the eager step.
``--memory-steps N`` runs N engine steps of a steady workload and prints the allocated bytes sampled.
``--dry-run`` runs it all on tiny shapes (the test suite does).

A run in which any request ends other than at its output length (an error, an abort, an early stop) says
how many and why and exits 1 after the report: its figures would not measure the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import minidsa
from minidsa.serving import bench
from minidsa.serving.cuda_graphs import DecodeGraphs, padded_decode_context, run_padded


def graph_check(model) -> dict:
    """One decode step of 5 sequences in the 8-row graph vs the same step eagerly (same cache contents)."""
    cache = model.new_cache()
    sids = [cache.add_sequence() for _ in range(5)]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for i, sid in enumerate(sids):
            model(torch.randint(0, 256, (1, 7 + 61 * i), generator=gen).to(model.device), cache=cache, seq_ids=[sid])
        cache.reserve({s: cache.seq_len(s) + 1 for s in sids})
        graphs = DecodeGraphs(model, cache, 8)
        graphs._capture(8)
        _, ids, ctx, logits = graphs.graphs[8]
        tokens = [3, 14, 15, 92, 65]
        ids.copy_(torch.tensor(tokens + [0, 0, 0]).view(8, 1))
        padded_decode_context(cache, sids, 8, graphs.max_blocks, model.device, into=ctx)
        graphs.graphs[8][0].replay()
        replayed = logits[:5].float().clone()
        eager = run_padded(model, ids, ctx)[:5].float()
        torch.cuda.synchronize()
        t = {}
        for name, fn in (("eager", lambda: run_padded(model, ids, ctx)), ("graph", graphs.graphs[8][0].replay)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t[name] = (time.perf_counter() - t0) / 20
    return {"max_abs_diff": float((replayed - eager).abs().max()), "same_argmax": bool(
        torch.equal(replayed.argmax(-1), eager.argmax(-1))), "eager_ms": t["eager"] * 1e3,
        "graph_ms": t["graph"] * 1e3}


def memory_run(model, steps: int, **engine_kw) -> dict:
    """A steady workload (a new request whenever one finishes) for ``steps`` steps; allocated bytes sampled."""
    engine = minidsa.Engine(model, **engine_kw)
    params = minidsa.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = bench.workload(64, (16, 96), (8, 24), seed=1)
    k = 0
    samples = []
    cuda = model.device.type == "cuda"
    for step in range(steps):
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < 8:
            engine.add_request(reqs[k % len(reqs)]["prompt"], params)
            k += 1
        engine.step()
        if step % max(1, steps // 10) == 0:
            samples.append(torch.cuda.memory_allocated(model.device) if cuda else len(engine.requests))
    return {"steps": steps, "requests": k, "samples": samples, "unit": "bytes" if cuda else "live requests"}


def dry_run() -> None:
    """The whole script on tiny shapes: engine figures, the sequential loop, a steady-workload run."""
    model = minidsa.load("default", progress=False)
    requests = bench.workload(4, (24, 48), (2, 6), 0, shared_prefix=20)
    # checkpoints every 16 tokens (the default interval is longer than the 20-token shared prefix): one to hit
    result = bench.run_engine(model, requests, bench.warmup_request(requests, 20), checkpoint_interval=16)
    result["sequential"] = bench.run_sequential(model, requests[:1])
    print(bench.format_report(result))
    mem = memory_run(model, 20)
    ok = result["successful_requests"] == 4 and result["prefix_hit_rate"] > 0 and len(mem["samples"]) == 10
    print("PASS" if ok else "FAIL", "dry run: 4 requests, prefix hits, 20 steady steps")
    if not ok:
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="laptop")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 128])
    ap.add_argument("--shared-prefix", type=int, default=0)
    ap.add_argument("--sequential-requests", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--no-prefix-caching", action="store_true", help="no KV/KDA prefix cache (and no KDA "
                    "checkpoints cutting a step's prefill pieces)")
    ap.add_argument("--compile-decode", action="store_true", help="torch.compile each decode graph's step (start-up "
                    "printed: Engine start-up)")
    ap.add_argument("--graph-check", action="store_true")
    ap.add_argument("--memory-steps", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--dry-run", action="store_true", help="the shipped tiny model, 4 short requests, on the CPU")
    args = ap.parse_args()
    if args.dry_run:
        dry_run()
        return
    model = minidsa.load(args.config, device=args.device, progress=False).set_backend(args.backend)
    out = {"config": args.config, "device": args.device, "backend": args.backend}
    if args.graph_check:
        out["graph_check"] = graph_check(model)
        print("graph check:", out["graph_check"])
    requests = bench.workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), 0,
                              args.shared_prefix)
    warmup = bench.warmup_request(requests, args.shared_prefix)
    kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              compile_decode=args.compile_decode, enable_prefix_caching=not args.no_prefix_caching)
    result = bench.add_ceiling(model, bench.run_engine(model, requests, warmup, **kw), tuple(args.input_len))
    print(bench.format_report(result), flush=True)
    failed = bench.failure(result)
    if failed:  # the figures measure nothing: say why, keep them in --json for the post-mortem, exit 1
        print("FAILED: " + failed, file=sys.stderr, flush=True)
        out["engine"] = result
        _write(args.json, out)
        sys.exit(1)
    if args.sequential_requests != 0:
        subset = requests[: args.sequential_requests] if args.sequential_requests else requests
        result["sequential"] = bench.run_sequential(model, subset)
        result["sequential"]["requests"] = len(subset)
        seq = result["sequential"]
        print(f"sequential generate(), first {len(subset)} requests: {seq['duration_s']:.2f} s, "
              f"{seq['output_throughput']:.2f} output tok/s; engine / sequential "
              f"{result['output_throughput'] / seq['output_throughput']:.2f}x", flush=True)
    out["engine"] = result
    if args.memory_steps:
        out["memory"] = memory_run(model, args.memory_steps, **kw)
        print("memory:", out["memory"], flush=True)
    _write(args.json, out)


def _write(path: str | None, out: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
