"""Baseline of the PyTorch reference ops on a GPU, as a fraction of the H200 limits (SPEC section 11:
~4.3 TB/s HBM, ~790 TFLOP/s bf16 dense). The Triton kernels, when they land, report against these
numbers in the same run; peers (torch SDPA) are timed here for scale.

    python benchmarks/diagnostics/reference_ops_gpu.py
"""

from __future__ import annotations

import torch

from minidsa import ops

HBM = 4.3e12  # bytes/s measured copy bandwidth on the H200 (SPEC section 11)
FLOPS = 790e12  # bf16 dense matmul


def bench(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> None:
    dev = "cuda"
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    # Decode: absorbed MLA over top-k latent rows. B sequences, H heads, latent 512 + rope 64, top-k 2048.
    B, H, S, K, R, DR = 32, 16, 8192, 2048, 512, 64
    q = torch.randn(B, 1, H, R + DR, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(B, S, 1, R + DR, device=dev, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(S, device=dev)[:K] for _ in range(B)]).view(B, 1, K).int()
    t = bench(lambda: ops.sparse_attention(q, kv, kv[..., :R], idx, 0.07, backend="torch"))
    moved = B * K * (R + DR) * 2  # the selected latent rows, bf16
    print(f"sparse_attention decode  B={B} H={H} topk={K}: {t * 1e6:8.1f} us, {moved / t / HBM * 100:5.1f} % of HBM")
    # Indexer scores for a prefill tile: T queries x S keys, 32 heads x 128.
    T, HI, D = 1024, 32, 128
    qi = torch.randn(1, T, HI, D, device=dev, dtype=torch.bfloat16)
    ki = torch.randn(1, S, D, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1, T, HI, device=dev)
    t = bench(lambda: ops.index_scores(qi, ki, w, D ** -0.5, backend="torch"))
    flop = 2 * T * S * HI * D
    print(f"index_scores  T={T} S={S} H={HI} D={D}: {t * 1e3:8.2f} ms, {flop / t / FLOPS * 100:5.1f} % of bf16 peak")
    scores = torch.randn(1, T, S, device=dev)
    pos = torch.arange(S - T, S, device=dev).view(1, T)
    t = bench(lambda: ops.topk_indices(scores, K, pos, backend="torch"))
    print(f"topk_indices  T={T} S={S} k={K}: {t * 1e3:8.2f} ms, {scores.numel() * 4 / t / HBM * 100:5.1f} % of HBM")
    # Peer: dense causal SDPA over the same keys (what DSA avoids at long context).
    qd = torch.randn(1, H, T, R + DR, device=dev, dtype=torch.bfloat16)
    kd = torch.randn(1, H, S, R + DR, device=dev, dtype=torch.bfloat16)
    vd = kd[..., :R]
    t = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd))
    print(f"peer: dense SDPA T={T} S={S} H={H}: {t * 1e3:8.2f} ms, "
          f"{2 * T * S * H * (2 * R + DR) / t / FLOPS * 100:5.1f} % of bf16 peak")
    # KDA chunked prefill (reference, fp32 math).
    Bk, Tk, Hk, Dk = 1, 4096, 16, 128
    qk = torch.nn.functional.normalize(torch.randn(Bk, Tk, Hk, Dk, device=dev), dim=-1)
    kk = torch.nn.functional.normalize(torch.randn(Bk, Tk, Hk, Dk, device=dev), dim=-1)
    vk = torch.randn(Bk, Tk, Hk, Dk, device=dev)
    g = -5 * torch.sigmoid(torch.randn(Bk, Tk, Hk, Dk, device=dev))
    beta = torch.rand(Bk, Tk, Hk, device=dev)
    t = bench(lambda: ops.kda_chunk(qk, kk, vk, g, beta, backend="torch"), reps=3)
    print(f"kda_chunk  T={Tk} H={Hk} K=V={Dk}: {t * 1e3:8.2f} ms ({Tk / t / 1e3:.0f} k tokens/s)")


if __name__ == "__main__":
    main()
