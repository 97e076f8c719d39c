"""Sparse MLA kernels (minidsa/ops/mla/latent_triton.py, prefill_triton.py) on the H200: time, peers, % of limit.

    PYTHONPATH=. python benchmarks/bench_mla.py            # GPU, full shapes (about a minute)
    PYTHONPATH=. python benchmarks/bench_mla.py --dry-run  # CPU, tiny shapes, Triton interpreter

Decode: B=32 sequences of 65,536 cached tokens, top-k 2048, H=96, r=512, dr=64, bf16, block size 64,
an out-of-order block table. Peers: the reference op, the fastest plain-torch sparse form (one
gather of the selected rows through the block table, bmm, softmax, bmm) and dense SDPA over all
cached keys. Roofline = max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s) (docs/design.md §11).

Prefill: B=1, T=32,768, top-k 2048, H=16, dn=128, dr=64, dv=128, r=512, over four selection patterns:
independent random picks (causal_topk: the worst case for aggregation) and picks of a shared
per-position importance plus noise (shared_topk, sigma 0.5, 0.25 and 0.1), where neighbouring queries
keep most of each other's picks (printed: the share the next query keeps, a 64-query tile's union / top-k).
For each: the op (prefill_triton.sparse_mla_prefill, which picks its form per call), each form
forced, and the FLOP rate of each form. Peers: dense causal SDPA on the decompressed q, k, v (the
target: the op should be >= 2x faster), the plain-torch sparse form chunked over queries, and the
reference op (too slow at full size: timed on evenly spaced 64-query tiles and scaled to all tiles, as
printed), the last two with the independent picks.

Decode indices are causal and distinct per query: the top-k of random scores among positions <= the
query's. Agreement with the plain-torch peer (and the reference, and between the two prefill forms) is
checked at bf16 tolerance and printed as PASS/FAIL. With $OUT set, results also go to $OUT/bench_mla.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _bench import graph_time, pick_device, timer, warm_up, write_results  # noqa: E402

HBM = 4.3e12  # bytes/s, measured H200 copy bandwidth (SPEC §11)
PEAK = 790e12  # FLOP/s, measured H200 bf16 dense matmul




def causal_topk_of(scores, T: int, ctx: int, K: int, device: str, chunk: int) -> torch.Tensor:
    """int32 [T, K]: query i (at position ctx - T + i) keeps the top-K of ``scores(rows)`` [len(rows), ctx]
    over positions <= its own; fewer candidates than K leave -1 at the end of the row (like
    ops.topk_indices)."""
    out = torch.empty(T, K, dtype=torch.int32, device=device)
    for t0 in range(0, T, chunk):
        rows = torch.arange(t0, min(T, t0 + chunk), device=device) + (ctx - T)
        s = scores(rows)
        s.masked_fill_(torch.arange(ctx, device=device)[None, :] > rows[:, None], float("-inf"))
        val, idx = s.topk(K, dim=-1)
        out[t0: t0 + rows.numel()] = torch.where(torch.isfinite(val), idx, -1).int()
    return out


def causal_topk(T: int, ctx: int, K: int, device: str, chunk: int = 2048) -> torch.Tensor:
    """Independent picks: the top-K of random scores (causal_topk_of)."""
    return causal_topk_of(lambda rows: torch.rand(rows.numel(), ctx, device=device), T, ctx, K, device, chunk)


def paged(latent: torch.Tensor, pe: torch.Tensor, bs: int, gen: torch.Generator):
    """Contiguous per-sequence rows [B, S, r] / [B, S, dr] -> planes [NB, bs, .] in a shuffled block
    order and the int32 block table [B, S / bs] that finds them."""
    B, S, r = latent.shape
    nb = S // bs
    perm = torch.randperm(B * nb, generator=gen).to(latent.device)
    kv_plane = torch.empty(B * nb, bs, r, dtype=latent.dtype, device=latent.device)
    pe_plane = torch.empty(B * nb, bs, pe.shape[-1], dtype=pe.dtype, device=pe.device)
    kv_plane[perm] = latent.reshape(B * nb, bs, r)
    pe_plane[perm] = pe.reshape(B * nb, bs, -1)
    return kv_plane, pe_plane, perm.view(B, nb).int()


def gather_selected(plane: torch.Tensor, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """plane [NB, bs, W], table [B, MB], idx [B, N] (-1 = padding) -> rows [B, N, W] (padding rows are
    row 0 of the plane; callers mask their scores). One indexing op for the rows."""
    bs = plane.shape[1]
    safe = idx.long().clamp_min(0)
    slots = table.long().gather(1, safe // bs) * bs + safe % bs
    return plane.view(-1, plane.shape[-1])[slots]


def torch_sparse_decode(q_lat, q_pe, kv_plane, pe_plane, table, idx, scale):
    """Plain-torch peer: q [B, H, r(+dr)] bf16 over the gathered rows; -> o_latent [B, H, r] fp32."""
    rows = torch.cat([gather_selected(kv_plane, table, idx), gather_selected(pe_plane, table, idx)], -1)
    s = torch.bmm(torch.cat([q_lat, q_pe], -1), rows.transpose(1, 2)).float() * scale  # [B, H, K]
    s = s.masked_fill((idx < 0)[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num_(0.0)
    return torch.bmm(p.to(rows.dtype), rows[..., : kv_plane.shape[-1]]).float()


def torch_sparse_prefill(q, kv_plane, pe_plane, table, idx, w, scale, chunk):
    """Plain-torch peer, absorbed form, chunked over queries: q [T, H, dn+dr] -> [T, H, dv] fp32."""
    T, H, _ = q.shape
    r, dr = kv_plane.shape[-1], pe_plane.shape[-1]
    dn = q.shape[-1] - dr
    wv = w.view(H, -1, r)
    w_uk, w_uv = wv[:, :dn], wv[:, dn:]
    out = torch.empty(T, H, wv.shape[1] - dn, dtype=torch.float32, device=q.device)
    for t0 in range(0, T, chunk):
        qc, ic = q[t0: t0 + chunk], idx[t0: t0 + chunk]
        q_lat = torch.bmm(qc[..., :dn].transpose(0, 1), w_uk).transpose(0, 1)  # [C, H, r]
        o_lat = torch_sparse_decode(q_lat, qc[..., dn:], kv_plane, pe_plane, table.expand(qc.shape[0], -1), ic, scale)
        out[t0: t0 + chunk] = torch.bmm(o_lat.to(w.dtype).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    return out


def report(name: str, t: float, peers: dict[str, float]) -> dict:
    line = f"  {name:<34s} {t * 1e3:10.3f} ms"
    print(line)
    for peer, tp in peers.items():
        if tp is None:
            print(f"  {peer:<34s}        n/a")
        else:
            print(f"  {peer:<34s} {tp * 1e3:10.3f} ms   kernel is {tp / t:6.2f}x faster")
    return {"kernel_ms": t * 1e3, **{f"{k}_ms": (None if v is None else v * 1e3) for k, v in peers.items()}}


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    err = float((got.float() - want.float()).abs().max())
    scale = float(want.float().abs().max())
    ok = math.isfinite(err) and err <= tol * max(scale, 1e-6)
    print(f"  agreement {name:<30s} max|diff| = {err:.3e} (output scale {scale:.3e}, tol {tol:g}): "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


def sm90_modules(op: str, dev: str) -> tuple:
    """(latent_gluon, prefill_gluon) where the op's sm_90 form runs on this machine, else (None, None)."""
    from minidsa.ops import _dispatch
    if dev != "cuda" or not _dispatch.gluon_runs(op, torch.cuda.current_device()):
        return None, None
    from minidsa.ops.mla import latent_gluon, prefill_gluon
    return latent_gluon, prefill_gluon


def bench_decode(dev: str, dry: bool, results: dict) -> bool:
    from minidsa.ops.mla import latent_triton as mt
    from minidsa.ops.mla.reference import sparse_mla_decode_ref
    B, S, K, H, r, dr, bs = (32, 65536, 2048, 96, 512, 64, 64) if not dry else (2, 96, 40, 3, 60, 12, 16)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter's bf16 tl.dot is wrong
    g = torch.Generator().manual_seed(0)
    scale = (128 + dr) ** -0.5
    latent = torch.randn(B, S, r, generator=g).to(dev, dt)
    kpe = torch.randn(B, S, dr, generator=g).to(dev, dt)
    kv_plane, pe_plane, table = paged(latent, kpe, bs, g)
    idx = torch.stack([causal_topk(1, S, K, dev)[0] for _ in range(B)]).view(B, 1, K)
    q_lat = torch.randn(B, 1, H, r, generator=g).to(dev, dt)
    q_pe = torch.randn(B, 1, H, dr, generator=g).to(dev, dt)
    bench = timer(dev)
    print(f"decode: B={B} context={S} top-k={K} H={H} r={r} dr={dr} {str(dt)[6:]} block_size={bs}")

    latent_gluon = sm90_modules("sparse_mla_decode", dev)[0]
    gluon = latent_gluon if latent_gluon is not None and latent_gluon.gluon_fits(kv_plane, pe_plane, H) else None

    def run(g=gluon):  # the op as "auto" runs it here: its sm_90 form on sm_90 (sm90_gluon.py), else Triton
        return mt.latent_decode(q_lat, q_pe, kv_plane, pe_plane, table, idx, scale, gluon=g)
    out = run()
    t_eager = bench(run)
    t_graph = graph_time(bench, run, dev)
    t_kernel = t_graph or t_eager  # the GPU time where it can be measured: the eager call is host bound
    t_portable = None
    if gluon:  # the same call on the portable Triton kernel (backend "triton"), for the ratio
        t_portable = graph_time(bench, lambda: run(None), dev)
        out_portable = run(None)
    ref = sparse_mla_decode_ref(q_lat, q_pe, kv_plane, pe_plane, table, idx, scale)
    t_ref = bench(lambda: sparse_mla_decode_ref(q_lat, q_pe, kv_plane, pe_plane, table, idx, scale))
    peer = torch_sparse_decode(q_lat[:, 0], q_pe[:, 0], kv_plane, pe_plane, table, idx[:, 0], scale)
    t_peer = bench(lambda: torch_sparse_decode(q_lat[:, 0], q_pe[:, 0], kv_plane, pe_plane, table, idx[:, 0], scale))
    # Dense peer: every cached key, contiguous (logical order). MQA: one latent KV head shared by the H
    # heads, so the heads are passed as H query rows of a single SDPA head (no K/V copy per head).
    kd = torch.cat([latent, kpe], -1).unsqueeze(1)  # [B, 1, S, r+dr]
    qd = torch.cat([q_lat, q_pe], -1)  # [B, 1, H, r+dr]: T=1, so the H heads sit in the query-row dim
    try:
        def dense():
            return F.scaled_dot_product_attention(qd, kd, kd[..., :r], scale=scale)
        dense()
        t_dense = bench(dense)
    except (RuntimeError, torch.OutOfMemoryError) as e:
        print(f"  dense SDPA failed: {type(e).__name__}: {str(e)[:100]}")
        t_dense = None
    del kd
    t_peer_graph = graph_time(bench, lambda: torch_sparse_decode(q_lat[:, 0], q_pe[:, 0], kv_plane, pe_plane, table,
                                                                idx[:, 0], scale), dev)
    print(f"  (kernel: {t_eager * 1e3:.3f} ms eager, host launch cost included; "
          f"{'n/a' if t_graph is None else f'{t_graph * 1e3:.3f} ms'} replayed from a CUDA graph, used below)")
    print(f"  kernel: {'Gluon, sm_90 (latent_gluon.py)' if gluon else 'Triton (latent_triton.py)'}")
    res = report("sparse_mla_decode (triton)", t_kernel, {"Triton kernel (when Gluon runs)": t_portable,
                                                         "reference op (torch)": t_ref,
                                                         "plain-torch sparse gather+bmm": t_peer,
                                                         "same, in a CUDA graph": t_peer_graph,
                                                         "dense SDPA over all keys": t_dense})
    res["kernel_eager_ms"] = t_eager * 1e3
    nbytes = B * K * (r + dr) * kv_plane.element_size() + q_lat.numel() * q_lat.element_size() * (r + dr) / r \
        + out.numel() * 4 + idx.numel() * 4
    flops = 2 * B * H * K * (r + dr) + 2 * B * H * K * r
    roof = max(nbytes / HBM, flops / PEAK)
    print(f"  bytes {nbytes / 1e6:.1f} MB ({nbytes / t_kernel / 1e12:.2f} TB/s), {flops / 1e9:.1f} GFLOP "
          f"({flops / t_kernel / 1e12:.0f} TFLOP/s): {roof / t_kernel * 100:.1f} % of the roofline "
          f"({'memory' if nbytes / HBM >= flops / PEAK else 'compute'} bound, {roof * 1e6:.1f} us)")
    tol = 2e-2 if dt == torch.bfloat16 else 1e-4
    ok = check("kernel vs reference", out[:, 0], ref[:, 0], tol) & check("kernel vs plain-torch", out[:, 0], peer, tol)
    if gluon:
        ok &= check("Gluon vs Triton kernel", out, out_portable, tol)
    results["decode"] = dict(res, shape=dict(B=B, S=S, K=K, H=H, r=r, dr=dr), bytes=nbytes, flops=flops,
                             pct_roofline=roof / t_kernel * 100, agree=ok)
    return ok


def shared_topk(T: int, K: int, sigma: float, device: str, chunk: int = 1024, seed: int = 0) -> torch.Tensor:
    """int32 [T, K]: query t keeps the top-K over positions <= t of a[s] + sigma * n[t, s], where a ~ N(0, 1)
    is one importance per position that every query shares and n is independent noise. sigma sets how
    many picks neighbouring queries share (an indexer's scores move slowly from one query to the next);
    sigma -> inf gives causal_topk's independent picks. Fewer than K candidates leave -1 at the end."""
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(T, device=device, generator=gen)
    return causal_topk_of(lambda rows: a[None, :] + sigma * torch.randn(rows.numel(), T, device=device, generator=gen),
                          T, T, K, device, chunk)


def selection_stats(idx: torch.Tensor, K: int, tile: int, samples: int = 16) -> tuple[float, float]:
    """(mean share of a query's picks that the next query keeps, mean size of a tile's union / K), over
    evenly spaced queries and tiles past the first K positions (where every query has K picks)."""
    T = idx.shape[0]
    starts = torch.linspace(K, T - tile - 1, samples).long().tolist() if T > K + tile + 1 else [0]
    share, union = [], []
    for t in starts:
        a, b = idx[t], idx[t + 1]
        share.append(torch.isin(b[b >= 0], a[a >= 0]).float().mean().item())
        rows = idx[t: t + tile]
        union.append(torch.unique(rows[rows >= 0]).numel() / K)
    return sum(share) / len(share), sum(union) / len(union)


def prefill_setup(dev: str, dry: bool):
    T, K, H, dn, dr, dv, r, bs = (32768, 2048, 16, 128, 64, 128, 512, 64) if not dry else (80, 24, 3, 10, 12, 7, 60, 16)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    latent = torch.randn(1, T, r, generator=g).to(dev, dt)
    kpe = torch.randn(1, T, dr, generator=g).to(dev, dt)
    kv_plane, pe_plane, table = paged(latent, kpe, bs, g)
    q = torch.randn(1, T, H, dn + dr, generator=g).to(dev, dt)
    w = (torch.randn(H * (dn + dv), r, generator=g) / math.sqrt(r)).to(dev, dt)
    print(f"prefill: T={T} top-k={K} H={H} dn={dn} dr={dr} dv={dv} r={r} {str(dt)[6:]} block_size={bs}")
    return dict(T=T, K=K, H=H, dn=dn, dr=dr, dv=dv, r=r), (q, kv_plane, pe_plane, table), w, latent, kpe


def dense_prefill_time(bench, q, latent, kpe, w, H: int, dn: int, scale: float) -> float:
    """Dense causal SDPA on decompressed tensors: q [1, H, T, dn+dr], k [1, H, T, dn+dr], v [1, H, T, dv]."""
    from minidsa.ops.mla.reference import decompress_kv
    k, v = decompress_kv(latent, kpe, w, H, dn)
    qd, kd, vd = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    del k, v
    return bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale), rep_ms=300)


def reference_prefill_time(args, idx, w, scale, out, tol) -> tuple[float, bool]:
    """The reference op on evenly spaced tiles of 64 queries (its own tile), scaled to all tiles; checks the
    kernel's output on the first and last sampled tile."""
    from minidsa.ops import PREFILL_TILE
    from minidsa.ops.mla.reference import sparse_mla_prefill_ref
    q, kv_plane, pe_plane, table = args
    T = q.shape[1]
    n_tiles = math.ceil(T / PREFILL_TILE)
    sample = sorted({int(x) for x in torch.linspace(0, n_tiles - 1, min(8, n_tiles)).round()})
    times, ok = [], True
    for i, tile in enumerate(sample):
        sl = slice(tile * PREFILL_TILE, (tile + 1) * PREFILL_TILE)
        ref = sparse_mla_prefill_ref(q[:, sl], kv_plane, pe_plane, table, idx[:, sl], w, scale)
        if q.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sparse_mla_prefill_ref(q[:, sl], kv_plane, pe_plane, table, idx[:, sl], w, scale)
        if q.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if i in (0, len(sample) - 1):
            ok &= check(f"kernel vs reference, tile {tile}", out[:, sl], ref, tol)
    print(f"  (reference timed on {len(sample)} of {n_tiles} tiles of {PREFILL_TILE} queries, scaled x{n_tiles})")
    return sum(times) / len(times) * n_tiles, ok


def form_flops(idx, table, shape: dict, bs: int) -> dict:
    """FLOPs each form executes (attention dots, with the absorbed form's two absorptions): the union form
    runs every (query, union slot) pair of its query tiles, the absorbed form every selected pair."""
    from minidsa.ops.mla import prefill_attn_triton as pa
    from minidsa.ops.mla import prefill_union_triton as pu
    T, H, dn, dr, dv, r = (shape[k] for k in ("T", "H", "dn", "dr", "dv", "r"))
    BM = pa.tile_config(idx.is_cuda, 2)[0]
    S = table.shape[1] * bs  # the op's S here: the table reaches no further than twice the prompt
    bits, n_valid = pu.bitmaps(idx.int(), table, bs, 1, T, S, idx.is_cuda)
    pairs, valid, _ = pu.tile_unions(bits, n_valid, 1, T, S, BM, idx.is_cuda)[3].tolist()  # the op's counts
    return {"union": 2 * H * pairs * (dn + dr + dv),
            "absorbed": 2 * H * valid * (2 * r + dr) + 2 * T * H * r * (dn + dv)}


def time_forms(bench, args, idx, w, scale) -> dict:
    """The op (form chosen per call) and each form forced: seconds, and each form's output, as backend "auto" runs
    them. On a GPU where the op's sm_90 form runs, also the union form on the portable Triton kernel
    ("union_triton", backend "triton")."""
    from minidsa.ops.mla import prefill_form as pf
    from minidsa.ops.mla import prefill_triton as mp
    q, kv_plane, pe_plane, table = args
    latent_gluon, prefill_gluon = sm90_modules("sparse_mla_prefill", "cuda" if q.is_cuda else "cpu")
    sm90 = dict(union_gluon=prefill_gluon, latent_gluon=latent_gluon)
    res, runs = {}, [("auto", "auto", sm90), ("union", "union", sm90), ("absorbed", "absorbed", sm90)]
    if prefill_gluon is not None:
        runs.append(("union_triton", "union", {}))
    for name, form, gluon in runs:
        pf.FORM = form
        res[name] = (bench(lambda: mp.prefill(q, kv_plane, pe_plane, table, idx, w, scale, **gluon), rep_ms=300),
                     mp.prefill(q, kv_plane, pe_plane, table, idx, w, scale, **gluon))
    pf.FORM = "auto"
    return res


def bench_prefill(dev: str, dry: bool, results: dict) -> bool:
    shape, args, w, latent, kpe = prefill_setup(dev, dry)
    T, K, H, dn, dr, dv, r = (shape[k] for k in ("T", "K", "H", "dn", "dr", "dv", "r"))
    q, kv_plane, pe_plane, table = args
    scale = (dn + dr) ** -0.5
    bench = timer(dev)
    tol = 3e-2 if q.dtype == torch.bfloat16 else 1e-4
    t_dense = dense_prefill_time(bench, q, latent, kpe, w, H, dn, scale)
    dense_flops = 2 * H * T * (T + 1) / 2 * (dn + dr + dv)
    print(f"  dense causal SDPA (decompressed) {t_dense * 1e3:.3f} ms: {dense_flops / 1e12:.2f} TFLOP, "
          f"{dense_flops / t_dense / 1e12:.0f} TFLOP/s; the 2x target is {t_dense / 2 * 1e3:.3f} ms")
    patterns = [("independent (random) picks", None), ("shared importance, sigma 0.5", 0.5),
                ("shared importance, sigma 0.25", 0.25), ("shared importance, sigma 0.1", 0.1)]
    ok, rows = True, {}
    for name, sigma in patterns:
        idx = causal_topk(T, T, K, dev) if sigma is None else shared_topk(T, K, sigma, dev)
        share, union = selection_stats(idx, K, 64)
        idx = idx.view(1, T, K)
        forms = time_forms(bench, args, idx, w, scale)
        t_op, out = forms["auto"]
        print(f"  selections: {name}: the next query keeps {share * 100:.0f} % of a query's picks; "
              f"a 64-query tile's union is {union:.2f} x top-k")
        peers = {"union form (forced)": forms["union"][0], "absorbed form (forced)": forms["absorbed"][0],
                 "dense causal SDPA (decompressed)": t_dense}
        if "union_triton" in forms:  # sm_90: the union form's attention on the Gluon kernel, and on Triton's
            peers["union form, Triton attention kernel (forced)"] = forms["union_triton"][0]
            ok &= check("union form: Gluon vs Triton attention kernel", forms["union"][1], forms["union_triton"][1],
                        tol)
        if sigma is None:  # the references do not depend on the selection pattern: timed once
            chunk = 1024 if not dry else 32
            peer = torch_sparse_prefill(q[0], kv_plane, pe_plane, table, idx[0], w, scale, chunk)
            peers["plain-torch sparse (chunked)"] = bench(
                lambda: torch_sparse_prefill(q[0], kv_plane, pe_plane, table, idx[0], w, scale, chunk), rep_ms=300)
            peers["reference op (torch, scaled)"], ref_ok = reference_prefill_time(args, idx, w, scale, out, tol)
            ok &= ref_ok & check("kernel vs plain-torch", out[0], peer, tol)
        res = report("sparse_mla_prefill (triton)", t_op, peers)
        flops = form_flops(idx, table, shape, kv_plane.shape[1])
        for form, f in flops.items():
            print(f"  {form} form: {f / 1e12:.2f} TFLOP, {f / forms[form][0] / 1e12:.0f} TFLOP/s "
                  f"({f / forms[form][0] / PEAK * 100:.1f} % of bf16 peak)")
        ok &= check("union vs absorbed form", forms["union"][1], forms["absorbed"][1], tol)
        met = "reached" if t_dense / t_op >= 2 else "not reached"
        print(f"  speed-up over dense SDPA {t_dense / t_op:.2f}x; target 2x: {met}")
        rows[name] = dict(res, next_query_keeps=share, tile_union_over_k=union, speedup_vs_dense=t_dense / t_op)
    results["prefill"] = dict(shape=shape, dense_ms=t_dense * 1e3, patterns=rows, agree=ok)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--only", choices=["decode", "prefill"], help="run one of the two")
    args = ap.parse_args()
    dev = pick_device("bench_mla.py", args.dry_run)
    if dev is None:
        return 0
    torch.manual_seed(0)
    warm_up(dev)
    results: dict = {}
    ok = True
    if args.only in (None, "decode"):
        ok &= bench_decode(dev, args.dry_run, results)
    if args.only in (None, "prefill"):
        if dev == "cuda":
            torch.cuda.empty_cache()
        ok &= bench_prefill(dev, args.dry_run, results)
    print("PASS" if ok else "FAIL")
    write_results("bench_mla", results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
