"""Online (routed experts -> shared FP8 workspace per forward) vs offline (all experts converted at
load) on this machine's CPU, measured in one run. Prints memory figures and the time ratio.

    python benchmarks/diagnostics/moe_online_offline.py [--config laptop] [--tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

import minidsa


def timed(model, ids, repeats):
    with torch.inference_mode():
        model(ids)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            model(ids)
            best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="laptop")
    ap.add_argument("--tokens", type=int, default=64, help="prefill length per forward")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = minidsa.load(args.config)
    torch.manual_seed(0)
    prefill = torch.randint(0, 256, (1, args.tokens))
    decode = torch.randint(0, 256, (1, 1))
    rows = []
    for mode in ("online", "offline"):
        t0 = time.perf_counter()
        model.set_expert_mode(mode)
        setup = time.perf_counter() - t0
        model.reset_expert_stats()
        t_pre = timed(model, prefill, args.repeats)
        conv_pre = model.expert_stats()["conversions"] / (args.repeats + 1)
        model.reset_expert_stats()
        t_dec = timed(model, decode, args.repeats)
        conv_dec = model.expert_stats()["conversions"] / (args.repeats + 1)
        rows.append((mode, setup, t_pre, t_dec, conv_pre, conv_dec, model.expert_stats()))
    s = rows[1][-1]
    mib = 2 ** 20
    print(f"config {args.config}: {len(model.moe_layers())} MoE layers x {model.config.moe.num_experts} experts")
    print(f"expert storage  MXFP4 {s['expert_bytes_mxfp4'] / mib:.2f} MiB vs bf16 {s['expert_bytes_bf16'] / mib:.2f} MiB "
          f"(ratio {s['expert_bytes_bf16'] / s['expert_bytes_mxfp4']:.2f}x)")
    print(f"FP8 workspace   {s['workspace_bytes'] / mib:.2f} MiB shared by all layers; offline FP8 copies "
          f"{s['offline_fp8_bytes'] / mib:.2f} MiB")
    for mode, setup, t_pre, t_dec, c_pre, c_dec, _ in rows:
        print(f"{mode:8s} setup {setup * 1e3:8.1f} ms | prefill {args.tokens} tok {t_pre * 1e3:8.1f} ms "
              f"({c_pre:.0f} conversions) | decode 1 tok {t_dec * 1e3:7.1f} ms ({c_dec:.0f} conversions)")
    print(f"online / offline time: prefill {rows[0][2] / rows[1][2]:.2f}x, decode {rows[0][3] / rows[1][3]:.2f}x")


if __name__ == "__main__":
    main()
