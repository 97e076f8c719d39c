"""The routed experts of one MoE layer call at decode batch sizes, three ways, on the GPU.

    PYTHONPATH=. python benchmarks/diagnostics/moe_decode_paths.py

The small config's shapes (64 experts of 512 x 512 MXFP4, top 8), seeded random codes and routing; for
2-64 tokens: ``expert_mlp_mxfp4`` with tensor-core tiles shared by an expert's tokens (the model's path),
the same op as matrix-vector products per routed pair, and converting every expert into an FP8 workspace
then ``expert_mlp_fp8``. Printed: do_bench medians, the routed experts' MXFP4 bytes at 4.3 TB/s, and the
tiles' largest difference from the reference (docs/design.md §17).
"""

from __future__ import annotations

import torch
import triton

import minidsa
from minidsa.ops.moe_experts import mlp_triton as mlp
from minidsa.ops.moe_experts.reference import expert_mlp_mxfp4_ref

HBM = 4.3e12
E, L, I, TOP_K = 64, 512, 512, 8


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("moe_decode_paths.py needs a CUDA GPU")
    torch.manual_seed(0)
    packed = torch.randint(0, 256, (E, 3, I * L // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(118, 124, (E, 3, I * L // 32), dtype=torch.uint8, device="cuda")
    ws_e = torch.empty(E, 3, I * L, dtype=torch.float8_e4m3fn, device="cuda")
    ws_s = torch.empty(E, 3, I * L // 32, dtype=torch.uint8, device="cuda")
    experts = torch.arange(E, device="cuda")

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us

    for N in (2, 8, 16, 32, 64):
        z = torch.randn(N, L, device="cuda")
        ids = torch.stack([torch.randperm(E, device="cuda")[:TOP_K] for _ in range(N)])
        routing = ((ids.unsqueeze(0) == experts.view(-1, 1, 1)) * torch.rand(N, TOP_K, device="cuda")).sum(-1)

        def mxfp4():
            return mlp.expert_mlp_mxfp4(z, packed, scales, experts, routing, 4.0, 25.0)

        def convert():
            minidsa.ops.mxfp4_to_fp8(packed, scales, experts, ws_e, ws_s, backend="triton")
            return minidsa.ops.expert_mlp_fp8(z, ws_e, ws_s, routing, 4.0, 25.0, backend="triton")

        kept = mlp.MXFP4_GEMV_MAX_TOKENS
        try:
            times = {"tiles": bench(mxfp4)}
            got = mxfp4()
            mlp.MXFP4_GEMV_MAX_TOKENS = N  # matrix-vector products for every routed pair
            times["matrix-vector"] = bench(mxfp4)
        finally:
            mlp.MXFP4_GEMV_MAX_TOKENS = kept
        times["convert + FP8"] = bench(convert)
        want = expert_mlp_mxfp4_ref(z, packed, scales, experts, routing, 4.0, 25.0)
        routed = int((routing != 0).any(1).sum())
        floor = routed * 3 * I * L * (0.5 + 1 / 32) / HBM * 1e6
        print(f"N={N}: {routed} routed experts, {floor:.1f} us at HBM speed | "
              + " | ".join(f"{k} {v:.1f} us ({floor / v:.1%} of HBM)" for k, v in times.items())
              + f" | tiles vs reference max|diff| {(got - want).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
