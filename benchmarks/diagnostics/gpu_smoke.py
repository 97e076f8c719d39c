"""Runs every path of the model on a CUDA device: cached decode vs full forward, generate with an
image, checkpoint round trip. Prints figures; exits non-zero on a mismatch.

    python benchmarks/diagnostics/gpu_smoke.py [--config small]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np
import torch

import minidsa


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    args = ap.parse_args()
    dev = "cuda"
    # fp64: DSA key and MoE expert choices flip on near-ties under fp32 rounding, which would make the
    # cached-vs-full comparison depend on the draw; in fp64 the paths agree to ~1e-12 on any seed.
    cfg = minidsa.load_config(args.config).replace(dtype="float64")
    model = minidsa.MiniDSA(cfg, device=dev)
    print(torch.cuda.get_device_name(), args.config, f"{model.num_parameters() / 1e6:.0f} M params")
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache()
        sid = cache.add_sequence()
        out = [model(ids[:, :280], cache=cache, seq_ids=[sid])]
        out += [model(ids[:, t: t + 1], cache=cache, seq_ids=[sid]) for t in range(280, 300)]
    diff = (torch.cat(out, 1) - full).abs().max().item()
    print(f"cached prefill+decode vs full forward, fp64 on GPU (seeded ids): max |diff| = {diff:.2e}")
    img = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    t = time.perf_counter()
    text = minidsa.generate("look", model, images=[img], max_new_tokens=32, temperature=0, stop_at_eos=False)
    torch.cuda.synchronize()
    print(f"generate with a 224x224 image, 32 tokens: {time.perf_counter() - t:.2f} s")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, max_shard_size="200MB")
        again = minidsa.load(d, device=dev, progress=False)
        with torch.inference_mode():
            same = torch.equal(again(ids[:, :50]), model(ids[:, :50]))
    print("checkpoint round trip exact:", same)
    return 0 if diff < 1e-9 and same and isinstance(text, str) else 1


if __name__ == "__main__":
    sys.exit(main())
