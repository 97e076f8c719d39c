"""Paged KV store on the H200: Triton kernel vs the reference op vs plain torch (docs/design.md §12).

    PYTHONPATH=. python benchmarks/bench_kv_store.py            # needs CUDA
    PYTHONPATH=. python benchmarks/bench_kv_store.py --dry-run  # tiny shapes, CPU interpreter, checks the logic

Shapes: one MLA layer's latent rows (kv_lora 512 + rope 64 = 576 wide, bf16) and the FP8 indexer-key
rows (128 wide), written for a prefill of 32,768 tokens and for a decode step of 32 tokens, with 1 in
16 slots set to -1 (padding). The store moves N * W * (read + write bytes): it is bound by HBM
bandwidth (4.3 TB/s measured on this H200, docs/design.md §11) at prefill sizes and by launch latency
at decode sizes. The peer is what plain torch does when it may read the mask on the host:
``flat[slots[valid]] = values[valid]`` (a boolean index: one device sync per call).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

DRY = "--dry-run" in sys.argv
if DRY and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from triton.testing import do_bench  # noqa: E402

from minidsa.ops.kv_store.reference import store_kv_ref  # noqa: E402
from minidsa.ops.kv_store.store_triton import store_kv  # noqa: E402

HBM = 4.3e12


def peer(plane: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    valid = slots >= 0
    plane.view(-1, plane.shape[-1])[slots[valid].long()] = values[valid].to(plane.dtype)


def seconds(fn, dev: str) -> float:
    """Mean seconds of fn(): triton's do_bench on the GPU, one wall-clock call in the interpreter."""
    if dev != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return do_bench(fn, warmup=20, rep=200) * 1e-3


def case(n: int, width: int, dtype: torch.dtype, dev: str = "cuda", block_size: int = 64) -> dict:
    gen = torch.Generator(device=dev).manual_seed(n + width)
    num_blocks = 2 * n // block_size + 8
    plane = torch.zeros(num_blocks, block_size, width, device=dev).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device=dev, generator=gen)[:n]
    slots[::16] = -1
    values = torch.randn(n, width, device=dev, generator=gen).to(dtype)
    results = {}
    planes = {}
    for name, fn in (("kernel", store_kv), ("reference", store_kv_ref), ("peer", peer)):
        planes[name] = plane.clone()
        try:
            fn(planes[name], slots, values)
        except RuntimeError as e:  # e.g. an indexed write torch lacks for this dtype on CUDA
            print(f"{name} failed for {dtype}: {str(e).splitlines()[0]}")
            results[name], planes[name] = float("nan"), None
            continue
        results[name] = seconds(lambda: fn(planes[name], slots, values), dev)
    same = all(planes[k] is None or torch.equal(planes["kernel"].view(torch.uint8), planes[k].view(torch.uint8))
               for k in ("reference", "peer"))
    moved = int((slots >= 0).sum()) * width * values.element_size() * 2
    return {"n": n, "width": width, "dtype": str(dtype), **{f"{k}_us": v * 1e6 for k, v in results.items()},
            "hbm_fraction": moved / results["kernel"] / HBM, "equal": same}


def main() -> None:
    if not torch.cuda.is_available() and not DRY:
        raise SystemExit("this benchmark needs a CUDA GPU (--dry-run checks the script on the CPU)")
    dev = "cuda" if torch.cuda.is_available() and not DRY else "cpu"
    sizes = (32768, 32) if dev == "cuda" else (200, 5)
    rows = [case(n, w, dt, dev) for n in sizes for w, dt in ((576, torch.bfloat16), (128, torch.float8_e4m3fn))]
    print(f"{'tokens':>7} {'width':>5} {'dtype':>15} {'kernel us':>9} {'ref us':>8} {'peer us':>8} "
          f"{'ref/kern':>8} {'peer/kern':>9} {'% HBM':>6}  check")
    for r in rows:
        print(f"{r['n']:7d} {r['width']:5d} {r['dtype'][6:]:>15} {r['kernel_us']:9.1f} {r['reference_us']:8.1f} "
              f"{r['peer_us']:8.1f} {r['reference_us'] / r['kernel_us']:8.1f}x {r['peer_us'] / r['kernel_us']:8.1f}x "
              f"{100 * r['hbm_fraction']:6.1f}  {'PASS' if r['equal'] else 'FAIL'}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_kv_store.json"), "w") as f:
            json.dump(rows, f, indent=1)
    ok = all(r["equal"] for r in rows)
    print("PASS: kernel planes equal the reference's and the peer's bit for bit" if ok else "FAIL: planes differ")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
