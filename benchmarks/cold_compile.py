"""First-run compile cost on the GPU: one process prefills prompts of ten lengths through the Triton
kernels (each then decodes 3 tokens) and prints, per length, the wall time and the kernel variants it
compiled. What a notebook user pays the first time each prompt length comes by.

    rm -rf ~/.triton/cache   # optional: without it, variants compiled by an earlier process load from disk
    PYTHONPATH=. python benchmarks/cold_compile.py [--config small]

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    config = minidsa.load_config(args.config)
    model = minidsa.MiniDSA(config, device="cuda")
    model.set_backend("triton")
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
