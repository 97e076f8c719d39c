"""Where one prefill step's GPU time goes: the step replayed from its CUDA graph under the profiler, its
kernels' GPU time summed by name and by family (MoE, KDA, MLA, GEMM, glue), for a few prompt shapes.

    PYTHONPATH=. python benchmarks/diagnostics/prefill_kernels.py --config small --shapes 1x128 1x1024 [--backend auto]

The step is what ``benchmarks/bench_prefill.py`` times ("graph"): B fresh sequences of T tokens as one packed
step, laid out to its shape and replayed. CUDA only.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from bench_prefill import graph_fn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import minidsa  # noqa: E402
from minidsa.serving.step_graphs import StepGraphs  # noqa: E402

FAMILIES = [("indexer scores", "paged_scores"), ("top-k", "row_sort|topk|radix|select"),
            ("MoE up", "_up_kernel"), ("MoE down", "_down_kernel"), ("MoE combine", "_combine_kernel"),
            ("MoE conversion", "_convert_kernel"), ("MoE plan and lists", "route|plan|lists|offsets|block_|slots|gates"),
            ("KDA", "_chunk|_solve|_state|_pairs|short_conv|_inputs|_decay"), ("MLA", "latent|union|attn_fwd"),
            ("GEMM", "gemm|cutlass|sm90|nvjet|cublas"), ("RMSNorm", "rms"), ("AttnRes", "_mix"),
            ("KV store", "store"), ("other Triton", "^_"),
            ("elementwise glue", "elementwise|vectorized|reduce|cat|copy|index|fill|scatter|gather|Memcpy")]


def family(name: str) -> str:
    return next((f for f, pattern in FAMILIES if re.search(pattern, name, re.I)), "other")


def profile_shape(model, B: int, T: int, top: int) -> None:
    cache = model.new_cache(num_blocks=B * -(-T // model.config.kv_block_size) + 1)
    ids = torch.randint(1, model.tokenizer.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)).cuda()
    step = graph_fn(StepGraphs(model, cache, max(8, B)), ids)
    with torch.inference_mode():
        step(), step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    time_by, count_by, fams = collections.Counter(), collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = e.device_time_total
            time_by[e.name[:70]] += t
            count_by[e.name[:70]] += 1
            fams[family(e.name)] += t
    print(f"== {B} x {T}: {sum(time_by.values()) / 1e3:.1f} ms GPU, {sum(count_by.values())} kernels")
    print("  by family (ms): " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in fams.most_common()))
    for name, t in time_by.most_common(top):
        print(f"  {t / 1e3:7.2f} ms {count_by[name]:5d}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--shapes", nargs="+", default=["1x128", "1x1024"], help="BxT: B sequences of T tokens")
    ap.add_argument("--top", type=int, default=25, help="kernels listed by GPU time")
    ap.add_argument("--backend", default="triton", choices=minidsa.ops.BACKENDS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_kernels.py profiles CUDA kernels: it needs a GPU")
    model = minidsa.load(args.config, device="cuda", progress=False).set_backend(args.backend)
    for shape in args.shapes:
        B, T = (int(x) for x in shape.split("x"))
        profile_shape(model, B, T, args.top)


if __name__ == "__main__":
    main()
