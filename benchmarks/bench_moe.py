"""Routed-expert kernels (minidsa/ops/moe_experts/*_triton.py) on an H200: conversion, fused MXFP4 MLP,
workspace FP8 MLP, against the reference ops and a bf16 plain-torch peer (docs/design.md §7, §11).

    PYTHONPATH=. python benchmarks/bench_moe.py                 # needs CUDA; about two minutes
    PYTHONPATH=. python benchmarks/bench_moe.py --experts 128   # fewer experts for conversion and prefill
    PYTHONPATH=. python benchmarks/bench_moe.py --dry-run       # tiny shapes, CPU interpreter, checks the logic

Shapes: K3 latent experts, L = 3584 -> I = 3072 -> L, top-16 routing. Decode routes over K3's 896
experts (``--decode-experts``), and also over the scaled count: how many distinct experts N tokens
route to decides the bytes that must be read. Conversion and prefill use a SCALED expert count
(``--experts``, default 256), so that MXFP4 storage (17.6 MB/expert), its offline FP8 copy
(34.1 MB), the FP8 workspace and the peer's bf16 weights of every expert (66.1 MB/expert) fit one GPU
together. Random MXFP4 weights, uniform random top-16 routing, router-like weights. Decode times are
GPU times, from CUDA-graph replays (an eager call's host launch cost is printed beside).

- decode, N = 1, 4, 8, 16 tokens: the fused MXFP4 kernel (``expert_mlp_mxfp4``), the workspace kernel
  alone on already converted slots (``expert_mlp_fp8``), the online workspace path (conversion of the
  min(N*16, E) slots + ``expert_mlp_fp8``), the reference op (N = 1 only: it dequantises every slot to
  fp32) and the peer: bf16 weights of the routed experts (already grouped contiguously, its best case,
  not timed) with batched torch matmuls (one bmm per matrix over the routed experts, no Python loop).
  % of 4.3 TB/s counts the weight bytes each variant must read for the routed experts: MXFP4
  17.6 MB, FP8 34.1 MB, bf16 66.1 MB per expert (the conversion adds 51.6 MB read + written per slot).
- prefill, N = 4096: fused, online workspace (convert all slots + MLP) and offline (the MLP over a
  FP8 copy of every expert converted once), and the peer (tokens grouped per expert, padded to the
  largest group, bmm). The reference is not timed at this size (dense over slots: [m, N, I] fp32
  intermediates); agreement is checked on the first 64 tokens.
- conversion bandwidth: ``mxfp4_to_fp8`` of 16 experts and of all experts.

Targets it reports against: conversion >= 60 % of 4.3 TB/s; fused decode >= 50 % on packed bytes and
>= 1.5x the bf16 peer; prefill online <= 1.25x offline. Agreement checks print PASS/FAIL (exit status 1 on a
FAIL). With $OUT set, results also go to $OUT/bench_moe.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from types import SimpleNamespace

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402
from _bench import graph_time, pick_device, timer, warm_up, write_results  # noqa: E402

from minidsa.formats import mxfp4  # noqa: E402
from minidsa.ops.activation.reference import situ_glu_values  # noqa: E402
from minidsa.ops.moe_experts import reference as ref  # noqa: E402

HBM = 4.3e12  # bytes/s, measured H200 copy bandwidth (docs/design.md §11)
BETA_G, BETA_U = 4.0, 25.0




def make_experts(E: int, L: int, I: int, dev: str, gen: torch.Generator):
    """Random MXFP4 storage [E, 3, I*L/2] + scales (codes 117..121: weights up to ~0.1)."""
    packed = torch.randint(0, 256, (E, 3, I * L // 2), dtype=torch.uint8, generator=gen, device=dev)
    scales = torch.randint(117, 122, (E, 3, I * L // 32), dtype=torch.uint8, generator=gen, device=dev)
    return packed, scales


def route(N: int, E: int, k: int, dev: str, gen: torch.Generator):
    """Uniform random top-k routing -> (conversion plan experts [m], routing [m, N]) as LatentMoE builds them:
    routed experts first in ascending id order, then unrouted placeholders, m = min(N*k, E)."""
    ids = torch.rand(N, E, generator=gen).topk(k, dim=-1).indices
    w = torch.rand(N, k, generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True)
    routed = torch.zeros(E, dtype=torch.bool).index_fill_(0, ids.reshape(-1), True)
    experts = torch.sort((~routed).to(torch.int8), stable=True).indices[: min(N * k, E)]
    routing = ((ids.unsqueeze(0) == experts.view(-1, 1, 1)) * w).sum(-1)
    return experts.to(dev), routing.to(dev), int(routed.sum())


def reference_by_chunks(z, packed, scales, experts, routing, chunk: int = 16):
    """The reference op over the routed slots, 16 slots at a time (its fp32 dequantisation of every slot
    would not fit at once); only slots with a routed token are evaluated."""
    live = (routing != 0).any(1).nonzero().view(-1)
    out = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32, device=z.device)
    for s in range(0, live.numel(), chunk):
        sl = live[s: s + chunk]
        out += ref.expert_mlp_mxfp4_ref(z, packed, scales, experts[sl], routing[sl], BETA_G, BETA_U)
    return out


def bf16_weights(packed, scales, ids, L: int, I: int):
    """bf16 [r, 3, I*L] weights of experts ``ids``, grouped contiguously (the peer's storage)."""
    out = torch.empty(len(ids), 3, I * L, dtype=torch.bfloat16, device=packed.device)
    for j, e in enumerate(ids):
        out[j] = mxfp4.dequantize(packed[e], scales[e], torch.bfloat16)
    return out


def peer_decode(z, w, routing, L: int, I: int):
    """bf16 plain-torch peer over r routed experts: w [r, 3, I*L] bf16, routing [r, N] -> y [N, L] fp32."""
    zb = z.to(torch.bfloat16)
    g = torch.matmul(zb, w[:, 0].view(-1, I, L).mT)  # [r, N, I]: one batched matmul over the experts
    u = torch.matmul(zb, w[:, 1].view(-1, I, L).mT)
    h = situ_glu_values(g.float(), u.float(), BETA_G, BETA_U) * routing.unsqueeze(-1)
    return torch.matmul(h.to(torch.bfloat16), w[:, 2].view(-1, L, I).mT).float().sum(0)


def peer_prefill(z, w, routing, L: int, I: int):
    """bf16 peer at prefill: each expert's routed tokens gathered and padded to the largest group, three
    bmm, then the weighted rows added back per token (index_add_). w [E, 3, I*L] in expert order."""
    E, N = routing.shape
    routed = routing != 0
    cap = int(routed.sum(1).max())
    order = torch.sort((~routed).to(torch.int8), dim=1, stable=True).indices[:, :cap]  # [E, cap] tokens
    valid = torch.gather(routed, 1, order)
    zb = torch.cat([z, z.new_zeros(1, L)]).to(torch.bfloat16)
    idx = torch.where(valid, order, N)
    x = zb[idx]  # [E, cap, L]
    g = torch.bmm(x, w[:, 0].view(E, I, L).mT)
    u = torch.bmm(x, w[:, 1].view(E, I, L).mT)
    gate = torch.where(valid, torch.gather(routing, 1, order), 0.0)
    h = situ_glu_values(g.float(), u.float(), BETA_G, BETA_U) * gate.unsqueeze(-1)
    y = torch.bmm(h.to(torch.bfloat16), w[:, 2].view(E, L, I).mT).float()
    return torch.zeros(N + 1, L, device=z.device).index_add_(0, idx.reshape(-1), y.reshape(-1, L))[:N]


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    err = float((got.float() - want.float()).abs().max())
    scale = float(want.float().abs().max())
    ok = math.isfinite(err) and err <= tol * max(scale, 1e-6)
    print(f"    agreement {name:<34s} max|diff| = {err:.3e} (output scale {scale:.3e}, tol {tol:g}): "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


def line(name: str, t: float, nbytes: float | None = None, base: float | None = None,
         flops: float | None = None) -> dict:
    extra = f"  {flops / t / 1e12:7.1f} TFLOP/s" if flops else ""
    if nbytes:
        tbs = nbytes / t / 1e12
        extra += f"  {nbytes / 1e9:7.3f} GB  {tbs:5.2f} TB/s = {tbs * 1e12 / HBM * 100:5.1f} % of 4.3 TB/s"
    if base:
        extra += f"  fused kernel is {t / base:5.2f}x faster"
    print(f"    {name:<40s} {t * 1e3:9.3f} ms{extra}")
    return {"ms": t * 1e3, "bytes": nbytes, "pct_hbm": (nbytes / t / HBM * 100) if nbytes else None,
            "tflops": flops / t / 1e12 if flops else None}


class Setup:
    """Shapes, storage, the FP8 workspace (capacity E) and the offline FP8 copy of every expert."""

    def __init__(self, dev: str, dry: bool, experts: int, offline: bool = True):
        self.dev, self.dry = dev, dry
        self.L, self.I, self.E, self.k = (96, 160, 8, 2) if dry else (3584, 3072, experts, 16)
        self.gen = torch.Generator().manual_seed(0)
        # drawn on the device: K3's 896 experts are 16 GB of MXFP4, slow to draw on the host
        self.packed, self.scales = make_experts(self.E, self.L, self.I, dev, torch.Generator(dev).manual_seed(0))
        n = self.I * self.L
        self.ws = (torch.empty(self.E, 3, n, dtype=torch.float8_e4m3fn, device=dev),
                   torch.empty(self.E, 3, n // 32, dtype=torch.uint8, device=dev))
        # the FP8 copy of every expert (conversion and prefill only)
        self.offline = (torch.empty_like(self.ws[0]), torch.empty_like(self.ws[1])) if offline else None
        # bytes per expert: MXFP4 storage, FP8 copy, conversion (read + write), bf16
        self.b_mx, self.b_fp8 = 3 * n / 2 + 3 * n / 32, 3 * n + 3 * n / 32
        self.b_conv, self.b_bf16 = self.b_mx + self.b_fp8, 3 * n * 2
        self.bench = timer(dev)


def bench_conversion(s: Setup, kern, results: dict) -> bool:
    print(f"conversion MXFP4 -> FP8 (per expert {s.b_mx / 1e6:.1f} MB read, {s.b_fp8 / 1e6:.1f} MB written)")
    n = min(16, s.E)
    ids = torch.randperm(s.E, generator=s.gen)[:n].to(s.dev)
    t16 = s.bench(lambda: kern.mxfp4_to_fp8(s.packed, s.scales, ids, *s.ws))
    els, scs = torch.empty_like(s.ws[0][:n]), torch.empty_like(s.ws[1][:n])
    t_ref = s.bench(lambda: ref.mxfp4_to_fp8_ref(s.packed, s.scales, ids, els, scs), rep_ms=100)
    exact = torch.equal(els.view(torch.uint8), s.ws[0][:n].view(torch.uint8)) and torch.equal(scs, s.ws[1][:n])
    print(f"    bit-exact against the reference ({n} experts): {'PASS' if exact else 'FAIL'}")
    every = torch.arange(s.E, device=s.dev)
    t_all = s.bench(lambda: kern.mxfp4_to_fp8(s.packed, s.scales, every, *s.offline))
    res = {"16": line(f"kernel, {n} experts", t16, n * s.b_conv),
           "ref16": line(f"reference op, {n} experts", t_ref, n * s.b_conv),
           "all": line(f"kernel, all {s.E} experts (offline copy)", t_all, s.E * s.b_conv)}
    pct = res["16"]["pct_hbm"]
    print(f"    target >= 60 % of 4.3 TB/s ({n} experts): {'reached' if pct >= 60 else 'not reached'}")
    results["conversion"] = dict(res, bit_exact=exact)
    return exact


def gpu_time(s: Setup, fn) -> float:
    """fn's GPU time: its CUDA-graph replay on the GPU, one eager call in a dry run."""
    return graph_time(s.bench, fn, s.dev) or s.bench(fn)


def bench_decode(s: Setup, kern, N: int, results: dict) -> bool:
    experts, routing, r = route(N, s.E, s.k, s.dev, s.gen)
    m = experts.numel()
    z = torch.randn(N, s.L, generator=s.gen).to(s.dev)
    print(f"decode N={N}: top-{s.k} of {s.E} experts -> {m} slots, {r} routed (the rest placeholders)")

    def fused_call():
        return kern.expert_mlp_mxfp4(z, s.packed, s.scales, experts, routing, BETA_G, BETA_U)

    def ws_call():
        return kern.expert_mlp_fp8(z, *s.ws, routing, BETA_G, BETA_U)

    def online():
        kern.mxfp4_to_fp8(s.packed, s.scales, experts, *s.ws)
        return ws_call()
    fused = fused_call()
    # GPU times from CUDA-graph replays: an eager decode call's host launch cost (three kernels and the
    # activation's planar copy, about 0.1 ms) is close to the one-token kernels' GPU time.
    t_fused = gpu_time(s, fused_call)
    t_eager = s.bench(fused_call) if s.dev == "cuda" else t_fused
    kern.mxfp4_to_fp8(s.packed, s.scales, experts, *s.ws)
    ws = ws_call()
    t_ws, t_online = gpu_time(s, ws_call), gpu_time(s, online)
    w = bf16_weights(s.packed, s.scales, experts[:r].tolist(), s.L, s.I)  # routed slots come first
    peer = peer_decode(z, w, routing[:r], s.L, s.I)
    t_peer = gpu_time(s, lambda: peer_decode(z, w, routing[:r], s.L, s.I))
    del w
    print(f"    (fused kernel eager, host launch cost included: {t_eager * 1e3:.3f} ms; GPU times below)")
    t_ref = None
    if N == 1:
        t_ref = s.bench(lambda: ref.expert_mlp_mxfp4_ref(z, s.packed, s.scales, experts, routing, BETA_G, BETA_U),
                        rep_ms=100)
    res = {"fused": line("expert_mlp_mxfp4 (fused kernel)", t_fused, r * s.b_mx),
           "workspace_mlp": line("expert_mlp_fp8 (converted slots)", t_ws, r * s.b_fp8, t_fused),
           "online": line("convert + expert_mlp_fp8 (online)", t_online, m * s.b_conv + r * s.b_fp8, t_fused),
           "peer": line("bf16 peer (batched torch matmuls)", t_peer, r * s.b_bf16, t_fused)}
    if t_ref is not None:
        res["reference"] = line("reference op (torch, fp32)", t_ref, None, t_fused)
    target_bw, target_peer = res["fused"]["pct_hbm"] >= 50, t_peer / t_fused >= 1.5
    print(f"    targets: >= 50 % of 4.3 TB/s {'reached' if target_bw else 'not reached'}; >= 1.5x the bf16 peer "
          f"{'reached' if target_peer else 'not reached'} ({t_peer / t_fused:.2f}x)")
    want = reference_by_chunks(z, s.packed, s.scales, experts, routing)
    tol = 1e-3 if s.dev == "cuda" else 1e-4
    # One token: both variants multiply exact fp32 weights by fp32 activations on the FMA units, so only
    # the summation order differs (1e-6). Several tokens: the FP8 MLP runs tensor-core passes whose
    # activations carry ~16 mantissa bits (a bf16 hi + lo split, 2^-17 relative per product), against
    # the fused kernel's exact products: ~1e-5 of the output scale over 3,000-term sums, so 1e-4.
    ok = check("fused vs reference", fused, want, tol)
    ok &= check("workspace vs fused", ws, fused, 1e-6 if N == 1 else 1e-4)
    ok &= check("bf16 peer vs fused", peer, fused, 3e-2)
    results[f"decode_E{s.E}_N{N}"] = dict(res, slots=m, routed=r, agree=ok, target_bw=target_bw, target_peer=target_peer)
    return ok


def bench_prefill(s: Setup, kern, N: int, results: dict) -> bool:
    experts, routing, r = route(N, s.E, s.k, s.dev, s.gen)
    m = experts.numel()
    z = torch.randn(N, s.L, generator=s.gen).to(s.dev)
    pairs = int((routing != 0).sum())
    flops = 2 * pairs * 3 * s.I * s.L
    print(f"prefill N={N}: top-{s.k} of {s.E} experts -> {m} slots, {r} routed, {pairs} (token, expert) pairs, "
          f"{flops / 1e12:.2f} TFLOP")
    fused = kern.expert_mlp_mxfp4(z, s.packed, s.scales, experts, routing, BETA_G, BETA_U)
    t_fused = s.bench(lambda: kern.expert_mlp_mxfp4(z, s.packed, s.scales, experts, routing, BETA_G, BETA_U),
                      rep_ms=500)

    def online():
        kern.mxfp4_to_fp8(s.packed, s.scales, experts, *s.ws)
        return kern.expert_mlp_fp8(z, *s.ws, routing, BETA_G, BETA_U)
    ws = online()
    t_online = s.bench(online, rep_ms=500)
    # Offline: the FP8 copy holds expert e in row e, so the routing rows go in expert-id order.
    by_id = torch.zeros(s.E, N, device=s.dev).index_copy_(0, experts, routing)
    offline = kern.expert_mlp_fp8(z, *s.offline, by_id, BETA_G, BETA_U)
    t_offline = s.bench(lambda: kern.expert_mlp_fp8(z, *s.offline, by_id, BETA_G, BETA_U), rep_ms=500)
    w = bf16_weights(s.packed, s.scales, list(range(s.E)), s.L, s.I)
    peer = peer_prefill(z, w, by_id, s.L, s.I)
    t_peer = s.bench(lambda: peer_prefill(z, w, by_id, s.L, s.I), rep_ms=500)
    del w
    res = {}
    for key, name, t in (("fused", "expert_mlp_mxfp4 (fused kernel)", t_fused),
                         ("online", "convert + expert_mlp_fp8 (online)", t_online),
                         ("offline", "expert_mlp_fp8 on the offline FP8 copy", t_offline),
                         ("peer", "bf16 peer (grouped tokens, bmm)", t_peer)):
        res[key] = line(name, t, None, t_fused if key != "fused" else None, flops)
    ratio = t_online / t_offline
    print(f"    online / offline = {ratio:.3f} (target <= 1.25: {'reached' if ratio <= 1.25 else 'not reached'}); "
          f"conversion of {m} slots moves {m * s.b_conv / 1e9:.1f} GB")
    n_chk = min(64, N)
    want = reference_by_chunks(z[:n_chk], s.packed, s.scales, experts, routing[:, :n_chk])
    tol = 1e-3 if s.dev == "cuda" else 1e-4
    ok = check(f"fused vs reference ({n_chk} tokens)", fused[:n_chk], want, tol)
    # The FP8 workspace kernel reduces each K tile in one product, the fused kernel per scale group: fp32 sums
    # of ~3,500 products in two orders part by ~sqrt(K) * 2^-24 of the scale, a few 1e-6 (a wrong weight: O(1)).
    ok &= check("online workspace vs fused", ws, fused, 2e-5) & check("offline vs online", offline, ws, 1e-5)
    ok &= check("bf16 peer vs fused", peer, fused, 3e-2)
    results[f"prefill_N{N}"] = dict(res, online_over_offline=ratio, pairs=pairs, flops=flops, agree=ok)
    return ok


def describe(s: Setup, results: dict) -> None:
    scaled = "K3's count" if s.E == 896 else "scaled from K3's 896"
    print(f"experts L={s.L} -> I={s.I} -> L, top-{s.k} of {s.E} ({scaled}); "
          f"per expert MXFP4 {s.b_mx / 1e6:.1f} MB, FP8 {s.b_fp8 / 1e6:.1f} MB, bf16 {s.b_bf16 / 1e6:.1f} MB")
    results.setdefault("shapes", []).append(dict(L=s.L, I=s.I, E=s.E, top_k=s.k, device=s.dev))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--experts", type=int, default=256,
                    help="scaled expert count of conversion, prefill and the second decode run (K3 has 896)")
    ap.add_argument("--decode-experts", type=int, default=896, help="expert count of the first decode run")
    ap.add_argument("--only", choices=["conversion", "decode", "prefill"])
    args = ap.parse_args()
    dev = pick_device("bench_moe.py", args.dry_run)
    if dev is None:
        return 0
    from minidsa.ops.moe_experts import convert_triton, mlp_triton
    kern = SimpleNamespace(mxfp4_to_fp8=convert_triton.mxfp4_to_fp8, expert_mlp_fp8=mlp_triton.expert_mlp_fp8,
                           expert_mlp_mxfp4=mlp_triton.expert_mlp_mxfp4)  # the three public kernels
    warm_up(dev)
    results: dict = {}
    ok = True
    if args.only in (None, "decode"):  # first, alone in memory: K3's 896 experts take 47 GB with the workspace
        for E in ((8,) if args.dry_run else dict.fromkeys((args.decode_experts, args.experts))):
            s = Setup(dev, args.dry_run, E, offline=False)
            describe(s, results)
            for N in ((1, 3) if args.dry_run else (1, 4, 8, 16)):
                ok &= bench_decode(s, kern, N, results)
            del s
    if args.only in (None, "conversion", "prefill"):  # prefill's offline path uses the offline copy made here
        s = Setup(dev, args.dry_run, args.experts)
        describe(s, results)
        ok &= bench_conversion(s, kern, results)
        if args.only in (None, "prefill"):
            ok &= bench_prefill(s, kern, 20 if args.dry_run else 4096, results)
    print("PASS" if ok else "FAIL")
    write_results("bench_moe", results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
