"""KDA Triton kernels (minidsa/ops/kda/*_triton.py) on the H200: time, reference, fla peer, % of roofline.

    PYTHONPATH=. python benchmarks/bench_kda.py            # GPU, full shapes
    PYTHONPATH=. python benchmarks/bench_kda.py --dry-run  # CPU, tiny shapes, Triton interpreter

Chunked prefill (``kda_chunk``, chunk 64): B=1, T=8192 and T=32768, 16 heads x K=V=128, bf16 q, k, v,
beta, fp32 log-decays g = -5 sigmoid(.) (the model's bounded decay), unit-norm q and k, an fp32
initial state. Target: no slower than 2x fla's ``chunk_kda``. Roofline = max(FLOPs of the chunked
algorithm / 790 TFLOP/s, bytes of inputs + outputs / 4.3 TB/s) (docs/design.md §11).

Recurrent decode (``kda_recurrent``, T=1): batch 64 x 96 heads x K=V=128, fp32 states. Target: at least
50 % of 4.3 TB/s on the state bytes read and written.

Peers: the reference ops (``kda_chunk_ref``, ``kda_recurrent_ref``) on the GPU (the chunk reference
holds [C, C, K] pair decays per chunk: above 8192 tokens it is timed on the first 8192 and scaled
linearly in T, as printed) and flash-linear-attention's ``chunk_kda`` / ``fused_recurrent_kda`` when
``import fla`` works (the fla-core wheel is pure Python: put it on PYTHONPATH; it is a peer only).
Agreement: fla's own criterion, RMS(difference) / RMS(reference) < 5e-3, of the kernel against the
reference (fp32 math on the same bf16 inputs) and against fla; printed as PASS/FAIL. With $OUT set,
results also go to $OUT/bench_kda.json.
"""

from __future__ import annotations

import argparse
import os
import sys

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402
from _bench import pick_device, timer, warm_up, write_results  # noqa: E402

HBM = 4.3e12  # bytes/s, measured H200 copy bandwidth (docs/design.md §11)
PEAK = 790e12  # FLOP/s, measured H200 bf16 dense matmul
RMS_TOL = 5e-3  # flash-linear-attention's bar for its kernels against its naive recurrence
REF_MAX_T = 8192  # longest sequence the chunk reference is run on (its pair decays are [C, C, K] per chunk)




def load_fla(dev: str):
    """(chunk_kda, fused_recurrent_kda) from flash-linear-attention, or None (printed)."""
    if dev != "cuda":
        print("fla not available (no GPU: its kernels are compiled Triton)")
        return None
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:  # ImportError, or an fla that does not match this torch/triton
        print(f"fla not available ({type(e).__name__}: {str(e)[:120]})")
        return None
    return chunk_kda, fused_recurrent_kda


def kda_inputs(B, T, H, K, V, dev, dtype, seed=0):
    """Model-like inputs: unit-norm q, k; beta in (0, 1); g = -5 sigmoid(.) fp32; fp32 initial state."""
    g = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    q = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(dtype)
    v = rnd(B, T, H, V).to(dtype)
    gate = -5.0 * torch.sigmoid(rnd(B, T, H, K))
    beta = torch.sigmoid(rnd(B, T, H)).to(dtype)
    return q, k, v, gate, beta, rnd(B, H, K, V) * 0.1


def rms_ratio(got, want) -> float:
    d = (got.float() - want.float()).pow(2).mean().sqrt()
    return float(d / want.float().pow(2).mean().sqrt().clamp_min(1e-30))


def check(name: str, got, want) -> bool:
    r = rms_ratio(got, want)
    ok = r < RMS_TOL and bool(torch.isfinite(got).all())
    print(f"  agreement {name:<34s} RMS ratio {r:.2e} (fla's bar {RMS_TOL:g}): {'PASS' if ok else 'FAIL'}")
    return ok


def report(name: str, t: float, peers: dict) -> dict:
    print(f"  {name:<36s} {t * 1e3:10.3f} ms")
    for peer, tp in peers.items():
        if tp is None:
            print(f"  {peer:<36s}        n/a")
        else:
            print(f"  {peer:<36s} {tp * 1e3:10.3f} ms   kernel is {tp / t:6.2f}x faster")
    return {"kernel_ms": t * 1e3, **{f"{k}_ms": (None if v is None else v * 1e3) for k, v in peers.items()}}


def chunk_cost(B, T, H, K, V, C, in_bytes, out_bytes) -> tuple[float, float]:
    """(FLOPs of the chunked algorithm, bytes of inputs + outputs). Per chunk and head: A_qk, A_kk
    (2 C^2 K each), W, U (2 C^2 K, 2 C^2 V), V_new = U - W S, S update, Qg S (2 C K V each), A_qk V_new
    (2 C^2 V); the 16 x 16 solves are negligible. Bytes: q, k, v, g, beta read, o written, two states."""
    n = B * H * -(-T // C)
    flops = n * (6 * C * C * K + 4 * C * C * V + 6 * C * K * V)
    return float(flops), float(in_bytes + out_bytes + 2 * B * H * K * V * 4)


def bench_chunk(T: int, dev: str, dry: bool, fla, results: dict) -> bool:
    from minidsa.ops.kda import chunk_triton as kt
    from minidsa.ops.kda.reference import kda_chunk_ref
    B, H, K, V = (1, 16, 128, 128) if not dry else (1, 2, 32, 32)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter's bf16 tl.dot is wrong
    q, k, v, g, beta, s0 = kda_inputs(B, T, H, K, V, dev, dt)
    bench = timer(dev, warmup=10)
    print(f"chunk (prefill): B={B} T={T} H={H} K={K} V={V} {str(dt)[6:]} chunk 64")
    o, s, _ = kt.kda_chunk(q, k, v, g, beta, None, s0, 64)
    t_kernel = bench(lambda: kt.kda_chunk(q, k, v, g, beta, None, s0, 64), rep_ms=300)
    # Reference: the first T_ref tokens (all of them up to REF_MAX_T), time scaled linearly in T.
    T_ref = min(T, REF_MAX_T if not dry else 64)  # the dry run takes the scaled path too
    pre = [x[:, :T_ref] for x in (q, k, v, g, beta)]
    o_ref, s_ref, _ = kda_chunk_ref(*pre, None, s0, 64)
    t_ref = bench(lambda: kda_chunk_ref(*pre, None, s0, 64), rep_ms=100) * T / T_ref
    if T_ref < T:
        print(f"  (reference timed on the first {T_ref} tokens and scaled x{T / T_ref:g})")
        o_pre, s_pre, _ = kt.kda_chunk(*pre, None, s0, 64)
    else:
        o_pre, s_pre = o, s
    ok = check("o: kernel vs reference", o_pre, o_ref) & check("state: kernel vs reference", s_pre, s_ref)
    t_fla = None
    if fla is not None:
        def peer():
            return fla[0](q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, output_final_state=True)
        o_fla, s_fla = peer()
        t_fla = bench(peer, rep_ms=300)
        check("o: kernel vs fla (information)", o, o_fla)
        check("o: fla vs reference (information)", o_fla[:, :T_ref], o_ref)
    res = report("kda_chunk (triton)", t_kernel, {"reference kda_chunk_ref": t_ref, "fla chunk_kda": t_fla})
    in_bytes = sum(x.numel() * x.element_size() for x in (q, k, v, g, beta))
    flops, nbytes = chunk_cost(B, T, H, K, V, 64, in_bytes, o.numel() * o.element_size())
    roof = max(flops / PEAK, nbytes / HBM)
    print(f"  {flops / 1e9:.1f} GFLOP ({flops / t_kernel / 1e12:.1f} TFLOP/s), {nbytes / 1e6:.0f} MB in+out "
          f"({nbytes / t_kernel / 1e12:.2f} TB/s): {roof / t_kernel * 100:.1f} % of the roofline "
          f"({'compute' if flops / PEAK >= nbytes / HBM else 'memory'} bound, {roof * 1e6:.1f} us)")
    if t_fla is not None:
        print(f"  target (no slower than 2x fla chunk_kda): {'reached' if t_kernel <= 2 * t_fla else 'not reached'} "
              f"({t_kernel / t_fla:.2f}x fla's time)")
    results[f"chunk_T{T}"] = dict(res, shape=dict(B=B, T=T, H=H, K=K, V=V), flops=flops, bytes=nbytes,
                                  pct_roofline=roof / t_kernel * 100, ref_scaled_from_T=T_ref, agree=ok)
    return ok


def bench_decode(dev: str, dry: bool, fla, results: dict) -> bool:
    from minidsa.ops.kda import recurrent_triton as kt
    from minidsa.ops.kda.reference import kda_recurrent_ref
    B, H, K, V = (64, 96, 128, 128) if not dry else (2, 3, 32, 32)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    q, k, v, g, beta, s0 = kda_inputs(B, 1, H, K, V, dev, dt, seed=1)
    bench = timer(dev, warmup=10)
    print(f"recurrent (decode): batch {B} x {H} heads, K={K} V={V}, {str(dt)[6:]} inputs, fp32 states")
    o, s = kt.kda_recurrent(q, k, v, g, beta, None, s0)
    t_kernel = bench(lambda: kt.kda_recurrent(q, k, v, g, beta, None, s0))
    o_ref, s_ref = kda_recurrent_ref(q, k, v, g, beta, None, s0)
    t_ref = bench(lambda: kda_recurrent_ref(q, k, v, g, beta, None, s0))
    ok = check("o: kernel vs reference", o, o_ref) & check("state: kernel vs reference", s, s_ref)
    t_fla = None
    if fla is not None:
        def peer():
            return fla[1](q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, output_final_state=True)
        o_fla, s_fla = peer()
        t_fla = bench(peer)
        check("state: kernel vs fla (information)", s, s_fla)
    res = report("kda_recurrent (triton)", t_kernel,
                 {"reference kda_recurrent_ref": t_ref, "fla fused_recurrent_kda": t_fla})
    state_bytes = 2 * s0.numel() * 4
    other = sum(x.numel() * x.element_size() for x in (q, k, v, g, beta, o))
    pct = state_bytes / t_kernel / HBM * 100
    print(f"  state bytes read + written {state_bytes / 1e6:.0f} MB: {state_bytes / t_kernel / 1e12:.2f} TB/s = "
          f"{pct:.1f} % of 4.3 TB/s (target 50 %: {'reached' if pct >= 50 else 'not reached'}); "
          f"all bytes {(state_bytes + other) / t_kernel / 1e12:.2f} TB/s")
    if t_fla is not None:
        print(f"  fla: {state_bytes / t_fla / HBM * 100:.1f} % of 4.3 TB/s on the same state bytes")
    results["decode"] = dict(res, shape=dict(B=B, H=H, K=K, V=V), state_bytes=state_bytes, pct_hbm=pct, agree=ok)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--only", choices=["chunk", "decode"], help="run one of the two")
    args = ap.parse_args()
    dev = pick_device("bench_kda.py", args.dry_run)
    if dev is None:
        return 0
    warm_up(dev)
    fla = load_fla(dev)
    results: dict = {"fla_available": fla is not None}
    ok = True
    if args.only in (None, "chunk"):
        for T in ((8192, 32768) if not args.dry_run else (40, 150)):
            ok &= bench_chunk(T, dev, args.dry_run, fla, results)
            if dev == "cuda":
                torch.cuda.empty_cache()
    if args.only in (None, "decode"):
        ok &= bench_decode(dev, args.dry_run, fla, results)
    print("PASS" if ok else "FAIL")
    write_results("bench_kda", results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
