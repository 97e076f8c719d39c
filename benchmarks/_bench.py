"""What the kernel benchmarks share: the device choice, a warm GPU, the timer and the JSON result.

Imported by ``benchmarks/bench_*.py`` (run as scripts, so this folder is on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import time

import torch


def pick_device(script: str, dry_run: bool) -> str | None:
    """"cuda", or "cpu" for a --dry-run (Triton's interpreter); None, after saying so, without a GPU."""
    if not torch.cuda.is_available() and not dry_run:
        print(f"{script} needs a CUDA GPU (H200); use --dry-run to check the script on the CPU")
        return None
    return "cuda" if torch.cuda.is_available() and not dry_run else "cpu"


def warm_up(device: str) -> None:
    """Print what runs, then a second of matmuls: an idle H200 sits at a low clock, which would make the
    first timings dishonest (seen: 263 us for MLA decode on a cold first call vs 159 us warm)."""
    if device != "cuda":
        return
    import triton
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        a @ a
    torch.cuda.synchronize()


def timer(device: str, warmup: int = 25):
    """bench(fn, rep_ms=200) -> median seconds of fn(): triton's do_bench on the GPU (L2 flushed between
    calls), one wall-clock call on the CPU."""
    def run(fn, rep_ms: int = 200) -> float:
        if device != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        import triton
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep_ms, return_mode="median") / 1e3
    return run


def cuda_graph(fn, warmups: int = 1):
    """``fn`` captured in a CUDA graph, after ``warmups`` calls on a side stream (kernel compiles and the
    allocator's first requests happen there, outside the capture). Replay it to time the GPU work
    without the host's launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_time(bench, fn, dev: str) -> float | None:
    """Seconds per call of ``fn`` replayed from a CUDA graph: the GPU time without the host's launch cost
    (an eager call of a decode op can cost more host time than its kernels take); None off the GPU."""
    return bench(cuda_graph(fn).replay) if dev == "cuda" else None


def write_results(name: str, results) -> None:
    """results as JSON to $OUT/<name>.json when OUT is set (the device tool brings $OUT back)."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as f:
            json.dump(results, f, indent=1)
