"""One whole-model decode step on the GPU: time, kernels, bytes against the memory roofline, and a dense peer.

    PYTHONPATH=. python benchmarks/bench_decode.py [--config small] [--batches 1 32] [--no-compile]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/bench_decode.py --dry-run   # CPU, tiny config

For each batch size the same seeded prompts are prefilled, then one decode step (the forward on a prepared
cache context, backend triton) is replayed from a CUDA graph, built two ways: eager (every op as it
launches) and ``torch.compile(fullgraph=True)`` (Inductor fuses the glue between the kernels, which are
``torch.library`` custom ops). Printed per row: step time, tokens/s, kernels per step and per layer
(counted by the profiler over one replay), the step's bytes and its memory roofline at 4.3 TB/s, the
fraction reached, and the time share by kernel family. The bytes: every weight a step reads in its
stored dtype (the embedding only its B rows), the routed experts' MXFP4 bytes (each distinct expert of a
layer once, counted from the step's own routing), the KV rows read (every cached indexer key, the top-k
latent rows) and the KDA states read and written.

The peer is a plain dense decoder of the same width and depth whose layers hold the same active
parameters per token (gpt-fast style: fused QKV, static KV cache, SDPA, SwiGLU), graph-replayed eager
and compiled. The compiled step's logits are compared with the eager step's: in bf16 the two round
differently, so a near-tie in a discrete choice (a DSA top-k key, a MoE expert) can flip and move the
logits far more than rounding would (the report says so beside the figure); ``--dtype float32`` makes
such flips rare. A dry run traces the step with ``fullgraph=True`` on the CPU (Dynamo only, the kernels in
Triton's interpreter) in fp32 and checks it to 1e-4, exiting 1 if it fails.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch
import torch.nn.functional as F
from _bench import cuda_graph, warm_up, write_results

import minidsa
from minidsa.model.moe import LatentMoE

HBM = 4.3e12  # H200 bytes/s (docs/design.md §11)

FAMILIES = (  # (family, substrings of kernel names), first match wins
    ("matrix products", ("_gemv_kernel", "gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk", "cublas")),
    ("project kernels", ("_recurrent_kernel", "_up_kernel", "_down_kernel", "_combine_kernel", "_decode",
                         "_convert", "_store", "_scores", "_topk", "_latent", "_mla", "_kda", "_route", "_row_")),
    ("inductor fused", ("triton_",)),
    ("copy / cast", ("copy", "memcpy", "memset", "cast", "convert")),
    ("reduction / norm", ("reduce", "norm", "softmax", "sort", "topk", "scan")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "index", "gather", "scatter", "fill", "cat")),
)


def family(name: str) -> str:
    low = name.lower()
    return next((f for f, keys in FAMILIES if any(k.lower() in low for k in keys)), "other")


def profile_replay(replay, device: str) -> tuple[int, dict[str, float], list]:
    """(kernels in one replay, {family: share of kernel time}, [(kernel, us)] in launch order)."""
    if device != "cuda":
        return 0, {}, []
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    times = collections.Counter()
    for e in events:
        times[family(e.name)] += e.device_time
    total = sum(times.values()) or 1.0
    kernels = [(e.name[:80], round(e.device_time, 2)) for e in sorted(events, key=lambda e: e.time_range.start)]
    return len(events), {f: t / total for f, t in times.most_common()}, kernels


def time_replay(replay, device: str, reps: int = 50) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        replay()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def graphed(fn, device: str):
    """fn as a replayable step: a CUDA graph on the GPU, the call itself on the CPU."""
    return cuda_graph(fn, warmups=3).replay if device == "cuda" else fn


# ---------------------------------------------------------------- minidsa
def prepare(model, batch: int, device: str, gen: torch.Generator):
    cache = model.new_cache()
    sids = [cache.add_sequence() for _ in range(batch)]
    lens = [96 + 37 * b % 160 for b in range(batch)]
    with torch.inference_mode():
        for sid, n in zip(sids, lens):
            model(torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device), cache=cache, seq_ids=[sid])
        ids = torch.full((batch, 1), 5, device=device)
        model(ids, cache=cache, seq_ids=sids)  # one eager step: fuses the projections, compiles the kernels
    return cache, sids, ids, lens


def step_fn(model, cache, sids, ids, device):
    ctx = cache.prepare(sids, 1, device)
    lm = model.language_model

    def step():
        return lm.lm_head(lm.model(lm.model.embed_tokens(ids), ctx, None))
    return step


def step_bytes(model, batch: int, lens: list[int], experts_per_layer: list[int]) -> dict[str, float]:
    cfg = model.config
    skip = ("vision_tower", "mm_projector", "embed_tokens", "experts.packed", "experts.scales")
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not any(s in n for s in skip))
    weights += batch * cfg.hidden_size * model.language_model.model.embed_tokens.weight.element_size()
    moe = model.moe_layers()[0]
    per_expert = (moe.experts.packed[0].numel() + moe.experts.scales[0].numel())
    experts = per_expert * sum(experts_per_layer)
    dtype_bytes = torch.empty((), dtype=cfg.torch_dtype).element_size()
    key = cfg.indexer.head_dim * (1 if cfg.indexer.fp8 else dtype_bytes) + (4 if cfg.indexer.fp8 else 0)
    latent = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * dtype_bytes
    kv = len(cfg.mla_layers) * sum((n + 1) * key + min(n + 1, cfg.indexer.topk) * latent for n in lens)
    state = cfg.kda.num_heads * cfg.kda.head_dim ** 2 * 4
    kda = len(cfg.kda_layers) * batch * 2 * state
    return {"weights": weights, "experts": experts, "kv": kv, "kda_state": kda,
            "total": weights + experts + kv + kda}


def routed_experts(model, step) -> list[int]:
    """Distinct experts each MoE layer reads in one step (from the step's own routing)."""
    seen, choose = [], LatentMoE.choose

    def spy(self, s):
        ids, w = choose(self, s)
        seen.append(int(torch.unique(ids).numel()))
        return ids, w
    LatentMoE.choose = spy
    try:
        with torch.inference_mode(), minidsa.ops.use_backend(model.backend):
            step()
    finally:
        LatentMoE.choose = choose
    return seen


# ---------------------------------------------------------------- the dense peer
class DensePeer(torch.nn.Module):
    """gpt-fast-style decoder: per layer RMSNorm, fused QKV, static KV cache + SDPA, RMSNorm, SwiGLU."""

    def __init__(self, d: int, layers: int, ffn: int, heads: int, vocab: int, batch: int, max_len: int,
                 dtype, device) -> None:
        super().__init__()
        self.h, self.hd = heads, d // heads
        mk = lambda *s: torch.nn.Parameter(torch.randn(*s, dtype=dtype, device=device) * 0.02)
        self.emb, self.head = mk(vocab, d), mk(vocab, d)
        self.wqkv = torch.nn.ParameterList(mk(3 * d, d) for _ in range(layers))
        self.wo = torch.nn.ParameterList(mk(d, d) for _ in range(layers))
        self.w13 = torch.nn.ParameterList(mk(2 * ffn, d) for _ in range(layers))
        self.w2 = torch.nn.ParameterList(mk(d, ffn) for _ in range(layers))
        self.register_buffer("k", torch.zeros(layers, batch, heads, max_len, self.hd, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros_like(self.k))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.emb[ids]  # [B, 1, d]
        B = x.shape[0]
        for l in range(len(self.wqkv)):
            h = F.rms_norm(x, (x.shape[-1],))
            q, k, v = F.linear(h, self.wqkv[l]).view(B, 1, 3, self.h, self.hd).transpose(1, 3).unbind(2)
            self.k[l].index_copy_(2, pos, k)
            self.v[l].index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, self.k[l], self.v[l], attn_mask=mask)
            x = x + F.linear(o.transpose(1, 2).reshape(B, 1, -1), self.wo[l])
            g, u = F.linear(F.rms_norm(x, (x.shape[-1],)), self.w13[l]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, self.w2[l])
        return F.linear(F.rms_norm(x, (x.shape[-1],)), self.head)


def active_params_per_layer(model) -> float:
    """Parameters one token reads per layer: everything but the routed experts, plus top_k of them."""
    cfg = model.config
    dense = sum(p.numel() for n, p in model.language_model.model.layers.named_parameters())
    per_expert = 3 * cfg.moe.latent_size * cfg.moe.expert_intermediate_size
    return (dense + len(model.moe_layers()) * cfg.moe.top_k * per_expert) / cfg.num_layers


# ---------------------------------------------------------------- one row
def run(config, batch: int, device: str, compile_: bool, quick: bool = False) -> dict:
    # on the CPU only the interpreter makes the kernels custom ops: the references' host checks break graphs
    interpret = device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    model = minidsa.MiniDSA(config, device=device).set_backend("triton" if device == "cuda" or interpret else "torch")
    compiler = dict(fullgraph=True, dynamic=False) | ({} if device == "cuda" else {"backend": "eager"})
    compile_ = compile_ and (device == "cuda" or interpret)
    cache, sids, ids, lens = prepare(model, batch, device, torch.Generator().manual_seed(batch))
    step = step_fn(model, cache, sids, ids, device)
    row = {"batch": batch}
    with torch.inference_mode(), minidsa.ops.use_backend(model.backend):
        want = step().float()
        variants = {} if quick and compile_ else {"eager graph": step}
        if compile_:
            minidsa.ops.register_custom_ops()
            variants["compiled graph"] = torch.compile(step, **compiler)
        for name, fn in variants.items():
            replay = graphed(fn, device)
            got = fn().float()
            dt = time_replay(replay, device, reps=50 if device == "cuda" else 1)
            kernels, shares, launches = profile_replay(replay, device)
            row[name] = {"step_ms": dt * 1e3, "tokens_per_s": batch / dt, "kernels": kernels,
                         "kernels_per_layer": kernels / config.num_layers, "shares": shares, "launches": launches,
                         "max_logit_diff_vs_eager": (got - want).abs().max().item()}
    experts = routed_experts(model, step)
    row["bytes"] = step_bytes(model, batch, lens, experts)
    row["roofline_us"] = row["bytes"]["total"] / HBM * 1e6
    # the peer: same width and depth, the same active parameters per layer
    d, L = config.hidden_size, config.num_layers
    ffn = max(64, int((active_params_per_layer(model) - 4 * d * d) / (3 * d)) // 64 * 64)
    row["peer"] = {"ffn": ffn}
    if quick:
        return row
    peer = DensePeer(d, L, ffn, config.mla.num_heads, config.vocab_size, batch, 512, config.torch_dtype, device)
    pos = torch.tensor([max(lens)], device=device)
    mask = (torch.arange(512, device=device) <= pos).view(1, 1, 1, -1)
    pids = torch.full((batch, 1), 5, device=device)
    with torch.inference_mode():
        peer_fns = {"eager graph": lambda: peer(pids, pos, mask)}
        if compile_:
            peer_fns["compiled graph"] = torch.compile(lambda: peer(pids, pos, mask), **compiler)
        for name, fn in peer_fns.items():
            replay = graphed(fn, device)
            replay()
            dt = time_replay(replay, device, reps=50 if device == "cuda" else 1)
            kernels, _, launches = profile_replay(replay, device)
            row["peer"][name] = {"step_ms": dt * 1e3, "tokens_per_s": batch / dt, "kernels": kernels,
                                 "launches": launches}
    return row


def report(config, row: dict) -> None:
    b, by = row["batch"], row["bytes"]
    print(f"\n{config.name} {config.dtype}, batch {b}: step bytes {by['total'] / 1e6:.1f} MB (weights "
          f"{by['weights'] / 1e6:.1f}, experts {by['experts'] / 1e6:.1f}, KV {by['kv'] / 1e6:.1f}, KDA state "
          f"{by['kda_state'] / 1e6:.1f}), roofline {row['roofline_us']:.0f} us at {HBM / 1e12:.1f} TB/s")
    for name in ("eager graph", "compiled graph"):
        if name not in row:
            continue
        r = row[name]
        frac = row["roofline_us"] / (r["step_ms"] * 1e3)
        print(f"  minidsa {name:15s} {r['step_ms']:7.3f} ms  {r['tokens_per_s']:9.0f} tok/s  {r['kernels']:5d} kernels "
              f"({r['kernels_per_layer']:.1f}/layer)  {frac:6.1%} of roofline  logits vs eager "
              f"{r['max_logit_diff_vs_eager']:.3g}")
        print("    time share: " + ", ".join(f"{f} {s:.0%}" for f, s in r["shares"].items()))
        if name == "compiled graph" and config.dtype == "bfloat16":
            print("    (logits vs eager in bfloat16: the compiled step's fused glue rounds differently, so a near-tie in "
                  "a discrete choice of the step, an MLA layer's DSA top-k keys or a MoE layer's experts, can flip and "
                  "move logits far beyond rounding; a large figure may be such a flip rather than a wrong kernel: "
                  "rerun with --dtype float32, where flips are rare and the figure measures rounding)")
    for name, r in row["peer"].items():
        if name != "ffn":
            print(f"  dense peer {name:12s} {r['step_ms']:7.3f} ms  {r['tokens_per_s']:9.0f} tok/s  "
                  f"{r['kernels']:5d} kernels (ffn {row['peer']['ffn']})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--dtype", default=None, help="override the config's dtype (float32: the compiled step's "
                    "logits then match the eager step's without discrete choices flipping on rounding)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the compiled graph only, no eager graph and no peer: "
                    "two trees compared in one device call (benchmarks/diagnostics/gpu_decode.sh)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny config: the trace checked, timings meaningless")
    args = ap.parse_args()
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        raise SystemExit("bench_decode.py needs a CUDA GPU; --dry-run checks it on the CPU")
    config = minidsa.load_config("tiny" if args.dry_run else args.config)
    if args.dry_run:  # a step in the interpreter takes seconds
        args.batches = [1]
    config = config.replace(max_sequences=max(config.max_sequences, max(args.batches)))
    if args.dtype:
        config = config.replace(dtype=args.dtype)
    warm_up(device)
    rows, failed = [], False
    for batch in args.batches:
        rows.append(run(config, batch, device, compile_=not args.no_compile, quick=args.quick))
        report(config, rows[-1])
        if args.dry_run and "compiled graph" in rows[-1]:  # fp32 on the CPU: the same choices, rounding apart
            diff = rows[-1]["compiled graph"]["max_logit_diff_vs_eager"]
            print(f"{'PASS' if diff <= 1e-4 else 'FAIL'}: batch {batch} traced with fullgraph=True, logits "
                  f"{diff:.2g} from the eager step (tolerance 1e-4)")
            failed = failed or diff > 1e-4
    write_results("bench_decode", rows)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
