"""Tile sweep of the MoE kernels on the H200 (a tuning aid, not a test): the conversion's BLOCK x warps and
the decode MLP's tiles, each timed on the bench_moe.py shapes (256 experts of L=3584, I=3072; 16 slots;
one decode token) and checked against the shipped configuration's output.

    PYTHONPATH=. python benchmarks/diagnostics/tune_moe.py
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _bench and the bench_* modules

import torch  # noqa: E402
from _bench import timer, warm_up  # noqa: E402
from bench_moe import BETA_G, BETA_U, HBM, make_experts  # noqa: E402

from minidsa.ops.moe_experts import convert_triton as convert  # noqa: E402
from minidsa.ops.moe_experts import mlp_triton as mlp  # noqa: E402


def main() -> None:
    dev = "cuda"
    warm_up(dev)
    run = timer(dev)
    L, I, E, slots = 3584, 3072, 256, 16
    gen = torch.Generator().manual_seed(0)
    packed, scales = make_experts(E, L, I, dev, torch.Generator(dev).manual_seed(0))
    experts = torch.randperm(E, generator=gen)[:slots].to(dev)
    elements = torch.empty(slots, 3, I * L, dtype=torch.float8_e4m3fn, device=dev)
    ws_scales = torch.empty(slots, 3, I * L // 32, dtype=torch.uint8, device=dev)
    moved = slots * 3 * (I * L // 2 + I * L + 2 * I * L // 32)
    convert.mxfp4_to_fp8(packed, scales, experts, elements, ws_scales)
    want = elements.view(torch.uint8).clone()
    print(f"conversion of {slots} experts ({moved / 1e9:.3f} GB moved)")
    for block, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16)):
        convert.CONVERT_BLOCK["cuda"], convert.CONVERT_WARPS = block, warps
        t = run(lambda: convert.mxfp4_to_fp8(packed, scales, experts, elements, ws_scales))
        ok = torch.equal(elements.view(torch.uint8), want)
        print(f"  BLOCK {block:6d} warps {warps:2d}: {t * 1e3:.3f} ms {moved / t / HBM * 100:5.1f} % HBM "
              f"{'exact' if ok else 'WRONG'}")
    z = torch.randn(1, L, generator=gen).to(dev)
    routing = torch.rand(slots, 1, generator=gen).to(dev)
    base = mlp._config
    want = mlp.expert_mlp_fp8(z, elements, ws_scales, routing, BETA_G, BETA_U)
    w_bytes = {"fp8": slots * 3 * I * L * (1 + 1 / 32), "mxfp4": slots * 3 * I * L * (0.5 + 1 / 32)}
    print("decode MLP, 1 token, 16 slots")
    for R, K, warps, stages in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3,)):
        mlp._config = lambda on_gpu, dense, c=dict(BLOCK_T=16, BLOCK_R=R, BLOCK_K=K, num_warps=warps,
                                                   num_stages=stages, BLOCK_S=16, BLOCK_L=256): \
            c if dense else base(on_gpu, dense)
        try:
            t8 = run(lambda: mlp.expert_mlp_fp8(z, elements, ws_scales, routing, BETA_G, BETA_U))
            t4 = run(lambda: mlp.expert_mlp_mxfp4(z, packed, scales, experts, routing, BETA_G, BETA_U))
            got = mlp.expert_mlp_fp8(z, elements, ws_scales, routing, BETA_G, BETA_U)
            err = (got - want).abs().max().item()
        except Exception as e:  # a tile that does not compile (shared memory) is reported, not fatal
            print(f"  R {R:3d} K {K:3d} warps {warps} stages {stages}: {type(e).__name__}")
            continue
        print(f"  R {R:3d} K {K:3d} warps {warps} stages {stages}: fp8 {t8 * 1e3:.3f} ms "
              f"{w_bytes['fp8'] / t8 / HBM * 100:5.1f} %  mxfp4 {t4 * 1e3:.3f} ms "
              f"{w_bytes['mxfp4'] / t4 / HBM * 100:5.1f} %  max|diff| {err:.1e}")
    mlp._config = base


if __name__ == "__main__":
    main()
