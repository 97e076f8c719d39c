"""First-run compile cost on the GPU: one process prefills prompts of ten lengths through the Triton
kernels (each then decodes 3 tokens) and prints, per length, the wall time and the kernel variants it
compiled. What a notebook user pays the first time each prompt length comes by. With ``--engine``, the
serving engine instead: the variants its start-up compiles (the decode graphs of every batch bucket), then
those the nano-vllm workload (``--num-requests`` of 100-1,024 tokens, 100-512 out) still compiles while
requests wait: each one stalls a step, and with it every running request, for about a second.

    rm -rf ~/.triton/cache   # optional: without it, variants compiled by an earlier process load from disk
    PYTHONPATH=. python benchmarks/diagnostics/cold_compile.py [--config small] [--engine [--num-requests 64]]

Triton compiles one variant per combination of constexprs and of the divisibility class (by 16, and
== 1) of every integer and pointer argument it specialises. A length that a kernel leaves unspecialised
(``do_not_specialize``) never compiles a new variant; the counts printed show which kernels still do.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import time

import torch

import minidsa
import minidsa.ops
from minidsa.serving.bench import workload
from minidsa.serving.params import SamplingParams

LENGTHS = (40, 57, 64, 96, 133, 160, 200, 255, 300, 301)


def jit_kernels() -> dict:
    """Every @triton.jit function of the package's *_triton / *_gluon modules (in the ops/<op>/ folders),
    by 'op.module.name'."""
    from triton.runtime.jit import JITFunction
    found = {}
    for info in pkgutil.walk_packages(minidsa.ops.__path__, "minidsa.ops."):
        if not info.name.endswith(("_triton", "_gluon")):
            continue
        module = importlib.import_module(info.name)
        short = info.name.removeprefix("minidsa.ops.")
        for name, obj in vars(module).items():
            while hasattr(obj, "fn") and not isinstance(obj, JITFunction):  # autotuner / heuristics wrappers
                obj = obj.fn
            if isinstance(obj, JITFunction) and obj.__module__ == info.name:  # not helpers imported from a sibling
                found[f"{short}.{name}"] = obj
    return found


def variants(kernels: dict) -> dict[str, int]:
    """Compiled variants per kernel, over every device (triton's per-device kernel caches)."""
    return {k: sum(len(cache[0]) for cache in f.device_caches.values()) for k, f in kernels.items()}


def engine_run(model: minidsa.MiniDSA, num_requests: int, max_num_seqs: int) -> None:
    """Variants compiled by the engine's start-up, then by the workload (with the seconds each part took)."""
    kernels = jit_kernels()
    before = variants(kernels)
    t0 = time.perf_counter()
    engine = minidsa.Engine(model, max_num_seqs=max_num_seqs)
    started = variants(kernels)
    t1 = time.perf_counter()
    requests = workload(num_requests, (100, 1024), (100, 512), 0)
    engine.generate([r["prompt"] for r in requests], [SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                                     ignore_eos=True) for r in requests],
                    progress=False)
    t2 = time.perf_counter()
    now = variants(kernels)
    new = {k: now[k] - started[k] for k in now if now[k] != started[k]}
    print(f"engine start-up: {t1 - t0:.1f} s, {sum(started.values()) - sum(before.values())} variants compiled")
    print(f"{num_requests} requests: {t2 - t1:.1f} s, {sum(new.values())} variants compiled meanwhile {new}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--engine", action="store_true", help="the serving engine's start-up and a workload instead")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    config = minidsa.load_config(args.config)
    model = minidsa.MiniDSA(config, device="cuda")
    model.set_backend("triton")
    if args.engine:
        return engine_run(model, args.num_requests, args.max_num_seqs)
    kernels = jit_kernels()
    before = variants(kernels)
    gen = torch.Generator().manual_seed(0)
    total_s, total_new = 0.0, 0
    for i, length in enumerate(LENGTHS):
        cache = model.new_cache()
        sid = cache.add_sequence()
        ids = torch.randint(0, config.vocab_size, (1, length), generator=gen).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            nxt = model(ids, cache=cache, seq_ids=[sid])[:, -1].argmax(-1, keepdim=True)
            for _ in range(3):
                nxt = model(nxt, cache=cache, seq_ids=[sid])[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        now = variants(kernels)
        new = {k: now[k] - before[k] for k in now if now[k] != before[k]}
        before = now
        if i:
            total_s, total_new = total_s + seconds, total_new + sum(new.values())
        print(f"prompt of {length} tokens: {seconds:.2f} s, {sum(new.values())} new variants {new}", flush=True)
    print(f"the {len(LENGTHS) - 1} lengths after the first: {total_s:.1f} s, {total_new} new variants")


if __name__ == "__main__":
    main()
