"""Tile sweep of the small kernels of one decode step on the H200 (a tuning aid, not a test): the one-row
projection, the tile projection of a decode batch, the router, the KDA decode step and the routed-expert
MLP, each at the small config's shapes.

    PYTHONPATH=. python benchmarks/diagnostics/tune_decode.py [--only gemv tile rows route kda moe combine]

A decode step reads every weight once, and the whole step (580 MB at batch 1) is far larger than the L2
cache, so each candidate is timed on enough distinct copies of its weights to overflow L2 (about 96 MB),
called back to back inside one CUDA graph: the time per call is what a replayed decode step pays, launch
gaps included, without the host.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _bench and the bench_* modules

import torch  # noqa: E402
import triton  # noqa: E402
from _bench import cuda_graph, warm_up, write_results  # noqa: E402
from bench_moe import BETA_G, BETA_U, make_experts  # noqa: E402

from minidsa.ops.kda import decode_triton as kda_dec  # noqa: E402
from minidsa.ops.linear import gemv_triton as gemv  # noqa: E402
from minidsa.ops.moe_experts import mlp_triton as mlp  # noqa: E402
from minidsa.ops.moe_router import route_triton as route  # noqa: E402

L2_BYTES = 96 * 2**20
results: list[dict] = []


def per_call(calls) -> float:
    """Microseconds per call of the callables ``calls``, replayed back to back from one CUDA graph."""
    graph = cuda_graph(lambda: [c() for c in calls])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(15):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def copies(nbytes: int) -> int:
    return max(2, min(64, -(-L2_BYTES // max(nbytes, 1))))


def record(kind: str, shape, cfg: dict, us: float, err: float | None = None) -> None:
    results.append(dict(kind=kind, shape=list(shape), cfg=cfg, us=us, err=err))
    print(f"  {kind} {shape} {cfg}: {us:7.2f} us" + ("" if err is None else f"  max|diff| {err:.1e}"), flush=True)


def sweep_gemv() -> None:
    # (N, K, dtype): the decoder's one-row products (KDA input, MoE input, MLA input, o_proj, latent up,
    # decay up, query up, the fp32 router)
    shapes = [(4176, 1024, torch.bfloat16), (2560, 1024, torch.bfloat16), (1760, 1024, torch.bfloat16),
              (1024, 1024, torch.bfloat16), (1024, 512, torch.bfloat16), (1024, 64, torch.bfloat16),
              (2560, 384, torch.bfloat16), (64, 1024, torch.float32)]
    for N, K, dt in shapes:
        n = copies(N * K * dt.itemsize)
        ws = [torch.randn(N, K, device="cuda", dtype=dt) for _ in range(n)]
        x = torch.randn(1, K, device="cuda", dtype=dt)
        outs = [torch.empty(1, N, device="cuda", dtype=dt) for _ in range(n)]
        print(f"gemv {N}x{K} {dt} ({n} copies)")
        record("gemv_cublas", (N, K), {}, per_call([lambda w=w, o=o: torch.mm(x, w.t(), out=o) for w, o in zip(ws, outs)]))
        want = (x.double() @ ws[0].double().t()).float()
        for bn, bk, warps in itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512, 1024), (1, 2, 4, 8)):
            if bk > triton.next_power_of_2(K) or bn * bk > 16384 or bn * bk < 32 * warps:
                continue

            def call(w, o, bn=bn, bk=bk, warps=warps):
                gemv._gemv_kernel[(triton.cdiv(N, bn),)](x, w, o, N, K, w.stride(0), w.stride(1), BLOCK_N=bn,
                                                         BLOCK_K=bk, PDL=False, num_warps=warps)
            try:
                us = per_call([lambda w=w, o=o: call(w, o) for w, o in zip(ws, outs)])
                call(ws[0], outs[0])
                err = (outs[0].float() - want).abs().max().item()
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                print(f"  bn {bn} bk {bk} warps {warps}: {type(e).__name__}")
                continue
            record("gemv", (N, K), dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps), us, err)
        del ws


def sweep_rows() -> None:
    """The fp32 router at decode batches of 2-64 rows: cuBLAS against the one-row kernel per row (``linear``)."""
    for m in (2, 8, 32, 64):
        w = torch.randn(64, 1024, device="cuda")
        x = torch.randn(m, 1024, device="cuda")
        ws = [w.clone() for _ in range(copies(w.numel() * 4))]
        print(f"router rows {m}x64x1024 fp32")
        record("rows_cublas", (m, 64, 1024), {}, per_call([lambda w=w: torch.mm(x, w.t()) for w in ws]))
        err = (gemv.linear(x, w).double() - x.double() @ w.double().t()).abs().max().item()
        record("rows", (m, 64, 1024), {}, per_call([lambda w=w: gemv.linear(x, w) for w in ws]), err)


def sweep_tile(M: int = 32) -> None:
    """The tile kernel for a decode batch of M rows against cuBLAS, at the bf16 products of sweep_gemv, and in
    fp32 (no TF32) at the router's shape."""
    shapes = [(4176, 1024, torch.bfloat16), (1024, 1024, torch.bfloat16), (2560, 384, torch.bfloat16),
              (64, 1024, torch.float32)]
    base = gemv._tile_config
    for N, K, dtype in shapes:
        n = copies(N * K * dtype.itemsize)
        ws = [torch.randn(N, K, device="cuda", dtype=dtype) for _ in range(n)]
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        outs = [torch.empty(M, N, device="cuda", dtype=dtype) for _ in range(n)]
        print(f"tile {M}x{N}x{K} {dtype} ({n} copies)")
        record("tile_cublas", (M, N, K), {}, per_call([lambda w=w, o=o: torch.mm(x, w.t(), out=o)
                                                       for w, o in zip(ws, outs)]))
        want = (x.double() @ ws[0].double().t()).float()
        configs = [*itertools.product((16,), (128, 256), (2, 4), (3, 4)), (32, 256, 4, 3), (16, 512, 2, 2)]
        if dtype == torch.float32:
            configs = [(16, 128, 2, 4)]
        for bn, bk, warps, stages in configs:
            gemv._tile_config = lambda m, on_gpu, c=(bn, bk, warps, stages): (max(16, triton.next_power_of_2(m)), *c)
            def tile(w):  # the kernel itself: linear sends fp32 rows elsewhere
                return gemv._tile_launch(x, w, None, None, M, N, K, 0)
            try:
                us = per_call([lambda w=w: tile(w) for w in ws])
                err = (tile(ws[0]).float() - want).abs().max().item()
            except Exception as e:  # noqa: BLE001
                print(f"  {bn} {bk} {warps} {stages}: {type(e).__name__}")
                continue
            record("tile", (M, N, K), dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages), us, err)
        gemv._tile_config = base
        del ws


def sweep_route() -> None:
    E, k = 64, 8
    for N in (1, 32):
        logits = [torch.randn(N, E, device="cuda") for _ in range(8)]
        bias = torch.randn(E, device="cuda") * 0.1
        ids = torch.empty(N, k, dtype=torch.int64, device="cuda")
        w = torch.empty(N, k, device="cuda")
        print(f"route N={N} E={E} k={k}")
        for bn, warps in itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 2, 4)):
            if bn > triton.next_power_of_2(N):
                continue

            def call(lg, bn=bn, warps=warps):
                route._route_kernel[(triton.cdiv(N, bn),)](lg, bias, ids, w, N, E, lg.stride(0), 1.0, 1e-20, TOP_K=k,
                                                           K_PAD=8, RENORM=True, BLOCK_N=bn, BLOCK_E=E,
                                                           num_warps=warps)
            record("route", (N, E, k), dict(BLOCK_N=bn, num_warps=warps), per_call([lambda lg=lg: call(lg) for lg in logits]))


def sweep_kda() -> None:
    H, K, R, W = 16, 64, 64, 4
    C = 3 * H * K
    for B in (1, 32):
        n = copies(B * H * K * K * 4 * 2)
        pools = [torch.randn(max(16, B), H, K, K, device="cuda") for _ in range(n)]
        conv_pool = torch.randn(max(16, B), W - 1, C, device="cuda")
        x = torch.randn(B, C, device="cuda", dtype=torch.bfloat16)
        f_a = torch.randn(B, R, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(B, H, device="cuda", dtype=torch.bfloat16)
        cw = torch.randn(C, 1, W, device="cuda", dtype=torch.bfloat16)
        w_fb = torch.randn(H * K, R, device="cuda", dtype=torch.bfloat16)
        A_log, dt = torch.zeros(128, device="cuda"), torch.zeros(H * K, device="cuda")
        slots = torch.arange(B, device="cuda", dtype=torch.int32)
        o = torch.empty(B, H, K, device="cuda")
        conv = torch.empty(B, W - 1, C, device="cuda")
        states = [torch.empty(B, H, K, K, device="cuda") for _ in range(n)]
        print(f"kda decode B={B} H={H} K={K} ({n} copies)")
        for bv, warps in itertools.product((8, 16, 32, 64), (1, 2, 4)):
            def call(pool, st, bv=bv, warps=warps):
                kda_dec._decode_kernel[(B * H, triton.cdiv(K, bv))](
                    x, f_a, b, cw, w_fb, A_log, dt, conv_pool, pool, slots, o, st, conv, H, K, R, x.stride(0),
                    f_a.stride(0), b.stride(0), -5.0, K ** -0.5, 1e-6, W=W, BLOCK_K=K, BLOCK_V=bv, BLOCK_R=32,
                    num_warps=warps)
            try:
                us = per_call([lambda p=p, s=s: call(p, s) for p, s in zip(pools, states)])
            except Exception as e:  # noqa: BLE001
                print(f"  bv {bv} warps {warps}: {type(e).__name__}: {e}")
                continue
            record("kda_decode", (B, H, K), dict(BLOCK_V=bv, num_warps=warps), us)


def sweep_moe() -> None:
    L = I = 512
    E, k = 64, 8
    gen = torch.Generator("cuda").manual_seed(0)
    per_layer = E * 3 * I * L * (0.5 + 1 / 32)
    n = copies(int(per_layer))
    layers = [make_experts(E, L, I, "cuda", gen) for _ in range(n)]
    base = mlp._config
    for N in (32, 8, 1):
        z = torch.randn(N, L, device="cuda", generator=gen)
        ids = torch.rand(N, E, device="cuda", generator=gen).topk(k, dim=1).indices
        experts = torch.arange(E, device="cuda") if N > 1 else ids[0]
        routing = ((ids.unsqueeze(0) == experts.view(-1, 1, 1)) * torch.rand(N, k, device="cuda", generator=gen)).sum(-1)
        mlp._config = base
        want = mlp.expert_mlp_mxfp4(z, *layers[0], experts, routing, BETA_G, BETA_U)
        print(f"expert MLP N={N} (E={E}, top {k}, L=I={L}, {n} copies of {per_layer / 2**20:.1f} MiB)")
        record("moe_shipped", (N,), {}, per_call([lambda p=p: mlp.expert_mlp_mxfp4(z, *p, experts, routing, BETA_G, BETA_U)
                                                  for p in layers]))
        if N == 1:
            continue
        for bt, br, bk, warps, stages in itertools.product((16, 32), (32, 64, 128), (64, 128, 256), (4, 8), (2, 3)):
            cfg = dict(BLOCK_T=bt, BLOCK_R=br, BLOCK_K=bk, num_warps=warps, num_stages=stages, BLOCK_S=16, BLOCK_L=256)
            mlp._config = lambda on_gpu, dense, N=1, c=cfg: c if dense else base(on_gpu, dense, N)
            try:
                us = per_call([lambda p=p: mlp.expert_mlp_mxfp4(z, *p, experts, routing, BETA_G, BETA_U) for p in layers])
                err = (mlp.expert_mlp_mxfp4(z, *layers[0], experts, routing, BETA_G, BETA_U) - want).abs().max().item()
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg}: {type(e).__name__}")
                continue
            record("moe", (N,), cfg, us, err)
    mlp._config = base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", default=["route", "kda", "gemv", "tile", "rows", "moe"])
    args = ap.parse_args()
    warm_up("cuda")
    for name in args.only:
        try:
            globals()[f"sweep_{name}"]()
        except Exception as e:  # noqa: BLE001 - one broken sweep must not hide the others
            print(f"sweep {name} failed: {type(e).__name__}: {e}")
        write_results("tune_decode", results)


if __name__ == "__main__":
    main()
