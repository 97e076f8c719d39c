"""Lightning-indexer kernels (minidsa/ops/indexer/scores_triton.py) on an H200: paged scores + causal top-k,
timed together, against the PyTorch reference ops and a plain-torch peer (docs/design.md §2, §11).

    PYTHONPATH=. python benchmarks/bench_indexer.py            # needs CUDA; about 30 s
    PYTHONPATH=. python benchmarks/bench_indexer.py --dry-run  # tiny shapes, CPU interpreter, checks the logic

Shapes: decode (B=32, 65,536 cached tokens each, 32 heads x 128, top-k 2048, block 64) with bf16 keys
and with fp8 keys + fp32 per-key scales; prefill (B=1, 4,096 new queries over 8,192 keys). The
physical blocks are shuffled, so the block table is out of order. Decode is memory-bound and reported
as the key bytes that must be read / time against 4.3 TB/s; prefill is compute-bound and reported as
the scores' FLOP/s against 790 TFLOP/s (docs/design.md §11). With $OUT set, results also go to
$OUT/bench_indexer.json. Exit status 1 if a correctness check fails.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

DRY = "--dry-run" in sys.argv
if DRY and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from minidsa.ops.indexer import reference as ref_ops  # noqa: E402
from minidsa.ops.indexer import scores_triton as kern  # noqa: E402
from minidsa.ops.indexer import topk_triton  # noqa: E402

HBM = 4.3e12  # bytes/s, measured copy bandwidth of the H200
FLOPS = 790e12  # bf16 dense matmul, measured


def timer(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls after a warm-up (CUDA events on the GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if DEV == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graph_timer(fn, calls: int = 10) -> float:
    """Seconds of GPU time per call: ``calls`` calls captured in one CUDA graph, replayed (median of 5).
    A decode step runs in a graph in serving engines (and here: benchmarks/diagnostics/decode_sync_gpu.py); it
    removes the host's launch cost, which for a chain of short kernels exceeds their GPU time."""
    if DEV != "cuda":
        return timer(fn, 1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, allocator) outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def make_case(B, T, H, D, ctx, bs, fp8, seed=0):
    """bf16 queries, fp32 weights, a key plane with its physical blocks shuffled across sequences."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    MB = -(-ctx // bs)
    NB = B * MB
    table = torch.randperm(NB, generator=g, device=DEV).view(B, MB).to(torch.int32)
    q = torch.randn(B, T, H, D, generator=g, device=DEV).to(torch.bfloat16)
    w = torch.randn(B, T, H, generator=g, device=DEV) * H ** -0.5
    keys = torch.randn(NB, bs, D, generator=g, device=DEV)
    if fp8:
        amax = keys.abs().amax(-1, keepdim=True).clamp_min(1e-4)
        kscale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
        plane = (keys / kscale).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        plane, kscale = keys.to(torch.bfloat16), None
    del keys
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    q_pos = torch.arange(ctx - T, ctx, device=DEV).expand(B, T).contiguous()
    return q, w, plane, kscale, table, lens, q_pos


def peer(q, w, plane, kscale, table, lens, q_pos, topk, scale):
    """The fastest plain-torch formulation found: one gather of the keys through the block table,
    a bf16 batched matmul with all heads as rows, ReLU, the head sum as a second matmul, torch.topk."""
    B, T, H, D = q.shape
    S = table.shape[1] * plane.shape[1]
    keys = plane[table.clamp_min(0)].view(B, S, D)
    if kscale is not None:  # power-of-two scales: the bf16 dequantisation is exact
        keys = keys.to(torch.bfloat16) * kscale[table.clamp_min(0)].view(B, S, 1).to(torch.bfloat16)
    logits = torch.bmm(q.reshape(B, T * H, D), keys.transpose(1, 2)).view(B, T, H, S)
    scores = torch.matmul(w.to(torch.bfloat16).unsqueeze(-2), torch.relu(logits * scale)).squeeze(-2).float()
    pos = torch.arange(S, device=q.device)
    scores = scores.masked_fill(pos >= lens.view(B, 1, 1), float("-inf"))
    idx = torch.topk(scores.masked_fill(pos > q_pos.unsqueeze(-1), float("-inf")), topk, dim=-1).indices
    return scores, idx


def selections_agree(scores_ref, idx_a, idx_b):
    """Sets chosen by two top-ks agree except at positions whose (reference) score is within a
    near-tie margin of the row's k-th best, where rounding may legitimately swap them."""
    S = scores_ref.shape[-1]
    flat = scores_ref.reshape(-1, S)
    a, b = idx_a.reshape(flat.shape[0], -1).long(), idx_b.reshape(flat.shape[0], -1).long()
    sel = []
    for idx in (a, b):
        m = torch.zeros_like(flat, dtype=torch.bool)
        m.scatter_(1, idx.clamp_min(0), idx >= 0)
        sel.append(m)
    kth = torch.gather(flat, 1, b[:, -1:].clamp_min(0))
    margin = 1e-3 * (flat.abs().amax(-1, keepdim=True) + 1e-6)
    differ = sel[0] ^ sel[1]
    outside = differ & ((flat - kth).abs() > margin)
    return int(outside.sum()) == 0, float(differ.sum()) / max(1, int(sel[1].sum()))


def run_case(name, B, T, H, D, ctx, bs, topk, fp8, reps):
    scale = D ** -0.5
    case = make_case(B, T, H, D, ctx, bs, fp8)
    q, w, plane, kscale, table, lens, q_pos = case
    args = (q, w, plane, kscale, table, lens)

    def kernel():
        return topk_triton.topk_indices(kern.paged_index_scores(*args, scale), topk, q_pos)

    def reference():
        return ref_ops.topk_indices_ref(ref_ops.paged_index_scores_ref(*args, scale), topk, q_pos)

    t_kernel = timer(kernel, reps)
    scores_k = kern.paged_index_scores(*args, scale)
    t_scores = timer(lambda: kern.paged_index_scores(*args, scale), reps)
    t_topk = timer(lambda: topk_triton.topk_indices(scores_k, topk, q_pos), reps)
    g_kernel = graph_timer(kernel)
    g_scores = graph_timer(lambda: kern.paged_index_scores(*args, scale))
    g_topk = graph_timer(lambda: topk_triton.topk_indices(scores_k, topk, q_pos))
    deterministic = torch.equal(kernel(), kernel())
    t_peer = timer(lambda: peer(*case, topk, scale), reps)
    idx_k = kernel()

    # The reference at full shape, or on the first rows of the batch when it does not fit.
    ref_rows = B
    while True:
        try:
            sub = (q[:ref_rows], w[:ref_rows], plane, kscale, table[:ref_rows], lens[:ref_rows])
            t_ref = timer(lambda: ref_ops.topk_indices_ref(ref_ops.paged_index_scores_ref(*sub, scale), topk,
                                                           q_pos[:ref_rows]), max(1, reps // 4))
            scores_r = ref_ops.paged_index_scores_ref(*sub, scale)
            idx_r = ref_ops.topk_indices_ref(scores_r, topk, q_pos[:ref_rows])
            break
        except torch.OutOfMemoryError:
            if ref_rows == 1:
                raise
            ref_rows //= 2
            torch.cuda.empty_cache()
    ref_note = "" if ref_rows == B else f" (measured on {ref_rows} of {B} rows, scaled x{B // ref_rows})"
    t_ref *= B / ref_rows

    # Checks. Kernel vs reference: same bf16/fp8 values, products exact in fp32, fp32 sums in other
    # orders -> ~1e-5 relative; allow 1e-3 of the row's score scale. Peer rounds its logits to bf16.
    finite = torch.isfinite(scores_r)
    err_ref = float((scores_k[:ref_rows] - scores_r).abs().where(finite, 0).max())
    scale_r = float(scores_r.where(finite, 0).abs().max())
    scores_p, _ = peer(*case, topk, scale)
    err_peer = float((scores_k - scores_p).abs().where(torch.isfinite(scores_p), 0).max())
    same_inf = bool(torch.equal(torch.isinf(scores_k[:ref_rows]), torch.isinf(scores_r)))
    sel_ok, sel_diff = selections_agree(scores_r, idx_k[:ref_rows], idx_r)
    # The kernel's top-k of the reference's own scores must equal the reference top-k exactly.
    topk_exact = torch.equal(topk_triton.topk_indices(scores_r, topk, q_pos[:ref_rows]), idx_r)
    ok = same_inf and err_ref <= 1e-3 * scale_r and err_peer <= 2e-2 * scale_r and sel_ok and topk_exact \
        and deterministic

    key_bytes = B * ctx * D * plane.element_size() + (B * ctx * 4 if fp8 else 0)
    flop = 2 * B * T * ctx * H * D
    res = dict(case=name, B=B, T=T, H=H, D=D, context=ctx, block_size=bs, topk=topk,
               keys="fp8+scale" if fp8 else "bf16", kernel_s=t_kernel, scores_s=t_scores, topk_s=t_topk,
               reference_s=t_ref, reference_rows=ref_rows, peer_s=t_peer, graph_kernel_s=g_kernel,
               graph_scores_s=g_scores, graph_topk_s=g_topk, hbm_fraction_graph=key_bytes / g_kernel / HBM,
               topk_exact=topk_exact, deterministic=deterministic,
               speedup_vs_reference=t_ref / t_kernel, speedup_vs_peer=t_peer / t_kernel,
               hbm_fraction=key_bytes / t_kernel / HBM, hbm_fraction_scores_only=key_bytes / t_scores / HBM,
               tflops_scores=flop / t_scores / 1e12, max_err_vs_reference=err_ref, max_err_vs_peer=err_peer,
               score_scale=scale_r, selection_diff_fraction=sel_diff, passed=ok)
    print(f"\n== {name}: B={B} T={T} H={H}x{D} context={ctx} block={bs} top-k={topk} keys={res['keys']}")
    print(f"  kernel (scores + top-k) {t_kernel * 1e6:10.1f} us   [scores {t_scores * 1e6:.1f} us, "
          f"top-k {t_topk * 1e6:.1f} us]  (eager: host launch cost included)")
    print(f"  same, in a CUDA graph   {g_kernel * 1e6:10.1f} us   [scores {g_scores * 1e6:.1f} us, "
          f"top-k {g_topk * 1e6:.1f} us]  (GPU time)")
    print(f"  reference ops           {t_ref * 1e6:10.1f} us{ref_note}   -> kernel {t_ref / t_kernel:6.1f}x faster")
    print(f"  torch peer              {t_peer * 1e6:10.1f} us   -> kernel {t_peer / t_kernel:6.2f}x faster")
    if T == 1:
        print(f"  key bytes {key_bytes / 1e6:.1f} MB: {res['hbm_fraction_graph'] * 100:5.1f} % of 4.3 TB/s with top-k "
              f"in a graph ({res['hbm_fraction'] * 100:.1f} % eager), {key_bytes / g_scores / HBM * 100:5.1f} % "
              f"for the scores alone")
    else:
        print(f"  scores {flop / 1e9:.0f} GFLOP: {res['tflops_scores']:.0f} TFLOP/s "
              f"({res['tflops_scores'] * 1e12 / FLOPS * 100:.1f} % of 790)")
    print(f"  max |kernel - reference| {err_ref:.2e}, |kernel - peer| {err_peer:.2e} (score scale {scale_r:.2f}); "
          f"selections differ at {sel_diff * 100:.3f} % of picks, all near-ties: {sel_ok}; top-k of the "
          f"reference scores exact: {topk_exact}; bitwise deterministic: {deterministic}  "
          f"-> {'PASS' if ok else 'FAIL'}")
    del case, args, scores_k, scores_r, scores_p
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> int:
    if DRY:
        cases = [("decode", 3, 1, 5, 60, 45, 8, 16, False), ("decode-fp8", 3, 1, 5, 60, 45, 8, 16, True),
                 ("prefill", 1, 9, 3, 32, 40, 8, 16, False)]
        reps = 2
    else:
        cases = [("decode", 32, 1, 32, 128, 65536, 64, 2048, False),
                 ("decode-fp8", 32, 1, 32, 128, 65536, 64, 2048, True),
                 ("prefill", 1, 4096, 32, 128, 8192, 64, 2048, False)]
        reps = 20
    print(torch.cuda.get_device_name() if DEV == "cuda" else "CPU (Triton interpreter, dry run: timings mean nothing)")
    torch.manual_seed(0)
    results = [run_case(*c, reps=reps) for c in cases]
    passed = all(r["passed"] for r in results)
    print(f"\n{'PASS' if passed else 'FAIL'}: kernel scores and selections match the reference")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_indexer.json")
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", dry_run=DRY,
                           results=results, passed=passed), f, indent=1)
        print(f"wrote {path}")
    return 0 if passed else 1


if torch.cuda.is_available():
    DEV = "cuda"
elif DRY:
    DEV = "cpu"
else:
    DEV = None

if __name__ == "__main__":
    if DEV is None:
        print("bench_indexer needs a CUDA GPU (an H200 for the reported numbers); "
              "use --dry-run to check the script on the CPU")
        sys.exit(0)
    sys.exit(main())
