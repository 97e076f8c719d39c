"""Prefill of fresh sequences on the GPU against a plain dense decoder of the same size, in one run.

    PYTHONPATH=. python benchmarks/bench_prefill.py [--config small] [--shapes 1x128 1x1024 1x4096 8x512]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/bench_prefill.py --dry-run   # CPU, tiny config

minidsa runs what the engine runs for a prefill-only step: B fresh sequences of T tokens packed on one
token axis (``prepare_step``, one forward, ``lm_head`` on each sequence's last token, the step published),
backend triton, wall clock from the host's call to the GPU's end, host cost included: eagerly, and as the
engine replays it, from the CUDA graph of the step's shape (serving/step_graphs.py; captured during the
warm-up, as the engine captures a shape the first time it meets it). Each repetition prefills new
sequences (freed after). The peer is a plain dense decoder of the same width and depth whose layers hold
the same active parameters per token (bench_decode.py's peer: fused QKV, SDPA causal, SwiGLU), eager, no
cache. Printed per shape: the eager time with its kernels and host synchronisations per forward (counted
by the profiler: a ``cudaStreamSynchronize`` or a blocking device-to-host copy), the graph's time, the
peer's, and the graph against the peer. The 1 x 128 times are the fixed cost of a forward.

``--by-module`` also counts, for one 1 x 128 forward, the aten ops each kind of module dispatches (on a GPU
nearly one kernel launch each; the Triton kernels do not go through aten and are not counted): where the
glue between the kernels is, by module and by op.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
import torch.nn.functional as F
from _bench import warm_up, write_results
from bench_decode import DensePeer, active_params_per_layer
from torch.utils._python_dispatch import TorchDispatchMode

import minidsa
from minidsa.cache import prepare_step
from minidsa.serving.step_graphs import StepGraphs

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class DensePrefill(DensePeer):
    """bench_decode.py's peer, its weights, run over whole prompts: per layer RMSNorm, fused QKV, causal SDPA,
    output projection, RMSNorm, SwiGLU; no cache (its static KV buffers are left at one slot)."""

    def __init__(self, d: int, layers: int, ffn: int, heads: int, vocab: int, dtype, device) -> None:
        super().__init__(d, layers, ffn, heads, vocab, 1, 1, dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb[ids]
        B, T, _ = x.shape
        for l in range(len(self.wqkv)):
            q, k, v = F.linear(F.rms_norm(x, (x.shape[-1],)), self.wqkv[l]).view(B, T, 3, self.h, self.hd).transpose(
                1, 3).unbind(2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, -1), self.wo[l])
            g, u = F.linear(F.rms_norm(x, (x.shape[-1],)), self.w13[l]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, self.w2[l])
        return F.linear(F.rms_norm(x[:, -1], (x.shape[-1],)), self.head)


def prefill_fn(model, cache, ids: torch.Tensor):
    """One prefill-only engine step of the rows of ``ids`` [B, T] as new sequences -> last logits [B, V]."""
    B, T = ids.shape
    flat = ids.reshape(1, -1)

    def run():
        sids = [cache.add_sequence() for _ in range(B)]
        try:
            step = prepare_step(cache, sids, [T] * B, ids.device, model.config.max_seq_len, sample=range(B))
            with minidsa.ops.use_backend(model.backend):
                hidden = model.language_model.model(model.language_model.model.embed_tokens(flat), step, None)
                logits = model.language_model.lm_head(hidden[0, step.logits_indices])
            step.publish()
            return logits
        finally:
            for s in sids:
                cache.free(s)
    return run


def graph_fn(graphs: StepGraphs, ids: torch.Tensor):
    """The same step replayed from the graph of its shape (``graphs.eager``: run shaped, uncaptured)."""
    B, T = ids.shape
    flat = ids.reshape(-1).tolist()
    cache = graphs.cache

    def run():
        sids = [cache.add_sequence() for _ in range(B)]
        try:
            shape = graphs.shape_for(sids, [T] * B)
            if not graphs.ready(shape):
                raise SystemExit(f"no graph for {shape}: {graphs.failed[shape]}")
            return graphs.run(shape, sids, [T] * B, flat, list(range(B)))
        finally:
            for s in sids:
                cache.free(s)
    return run


def wall(fn, device: str, reps: int) -> float:
    """Median wall seconds of fn(), synchronised on both sides (host cost included)."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def census(fn, device: str) -> tuple[int, int]:
    """(GPU kernels, host synchronisations) of one call, from the profiler."""
    if device != "cuda":
        return 0, 0
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
                  and "memset" not in e.name.lower())
    syncs = sum(1 for e in events if e.name in SYNC_EVENTS)
    return kernels, syncs


MODULE_KINDS = ("KimiDeltaAttention", "GatedMLA", "LightningIndexer", "LatentMoE", "SituGluMLP", "RMSNorm")
VIEWS = {"view", "_unsafe_view", "reshape", "select", "slice", "unsqueeze", "squeeze", "mT", "t", "transpose", "permute",
         "expand", "as_strided", "split", "split_with_sizes", "unbind", "detach", "alias", "diagonal", "unfold",
         "narrow", "chunk", "view_as", "lift_fresh", "empty", "empty_strided", "new_empty"}  # launch no kernel


class _OpCounter(TorchDispatchMode):
    """Counts every aten op but views and allocations (which launch nothing) by the innermost module kind
    running it ("decoder" for the residual mixers and the embedding)."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack, self.counts = stack, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in VIEWS:
            where = self.stack[-1] if self.stack else "decoder"
            self.counts[where] += 1
            self.counts[(where, name)] += 1
        return func(*args, **(kwargs or {}))


def ops_by_module(model, fn) -> collections.Counter:
    """Aten ops of one ``fn()`` per module kind (str keys) and per (kind, op) (tuple keys)."""
    stack: list[str] = []
    hooks = []
    for mod in model.modules():
        kind = type(mod).__name__
        if kind in MODULE_KINDS:
            hooks.append(mod.register_forward_pre_hook(lambda m, a, k=kind: stack.append(k)))
            hooks.append(mod.register_forward_hook(lambda m, a, o: stack.pop() and None))  # None: keep the output
    try:
        with torch.inference_mode(), _OpCounter(stack) as counter:
            fn()
    finally:
        for h in hooks:
            h.remove()
    return counter.counts


def print_ops_by_module(counts: collections.Counter, layers: int, top: int = 6) -> None:
    kinds = [(k, n) for k, n in counts.most_common() if isinstance(k, str)]
    print(f"aten ops of one forward, views and allocations left out: {sum(n for _, n in kinds)} ({layers} layers)")
    for kind, n in kinds:
        ops = sorted(((op, c) for (w, op), c in ((k, c) for k, c in counts.items() if isinstance(k, tuple))
                      if w == kind), key=lambda x: -x[1])
        print(f"  {kind:20s} {n:6d}   " + ", ".join(f"{op} {c}" for op, c in ops[:top]))


def run_shape(model, peer, batch: int, tokens: int, device: str, reps: int) -> dict:
    cache = model.new_cache(num_blocks=batch * -(-tokens // model.config.kv_block_size) + 1)
    ids = torch.randint(1, model.tokenizer.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    ours = prefill_fn(model, cache, ids)
    graphed = graph_fn(StepGraphs(model, cache, max(8, batch), eager=device != "cuda", capture_after=1), ids)
    with torch.inference_mode():
        for _ in range(2):  # compiles, autotuning, first allocations, the graph's capture
            ours(), graphed(), peer(ids)
        row = {"batch": batch, "tokens": tokens, "eager_ms": wall(ours, device, reps) * 1e3,
               "minidsa_ms": wall(graphed, device, reps) * 1e3, "peer_ms": wall(lambda: peer(ids), device, reps) * 1e3}
        row["kernels"], row["syncs"] = census(ours, device)
        row["peer_kernels"], _ = census(lambda: peer(ids), device)
    row["ratio"] = row["minidsa_ms"] / row["peer_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--shapes", nargs="+", default=["1x128", "1x1024", "1x4096", "8x512"], help="BxT: B sequences of T")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--by-module", action="store_true", help="also count the aten ops of one forward by module")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny config, one small shape: the script checked")
    args = ap.parse_args()
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        raise SystemExit("bench_prefill.py needs a CUDA GPU; --dry-run checks it on the CPU")
    config = minidsa.load_config("tiny" if args.dry_run else args.config)
    shapes = [(1, 40), (2, 24)] if args.dry_run else [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    config = config.replace(max_seq_len=max(config.max_seq_len, max(t for _, t in shapes)),
                            max_sequences=max(config.max_sequences, max(b for b, _ in shapes)))
    warm_up(device)
    model = minidsa.MiniDSA(config, device=device).set_backend("triton" if device == "cuda" else "torch")
    ffn = max(64, int((active_params_per_layer(model) - 4 * config.hidden_size ** 2) / (3 * config.hidden_size)))
    peer = DensePrefill(config.hidden_size, config.num_layers, ffn // 64 * 64 or 64, config.mla.num_heads,
                        config.vocab_size, model.language_model.lm_head.weight.dtype, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run: timings meaningless)"
    print(f"prefill, {config.name} {config.dtype} on {name}; peer: dense, ffn {ffn // 64 * 64}, SDPA causal, eager")
    print(f"{'batch x tokens':>15s} {'eager':>10s} {'kernels':>8s} {'syncs':>6s} {'graph':>10s} {'dense peer':>11s} "
          f"{'graph vs peer':>14s}")
    rows = []
    for b, t in shapes:
        r = run_shape(model, peer, b, t, device, 2 if args.dry_run else args.reps)
        rows.append(r)
        faster = f"{1 / r['ratio']:.2f}x faster" if r["ratio"] < 1 else f"{r['ratio']:.2f}x slower"
        print(f"{b:>7d} x {t:<5d} {r['eager_ms']:8.1f} ms {r['kernels']:8d} {r['syncs']:6d} {r['minidsa_ms']:8.1f} ms "
              f"{r['peer_ms']:8.1f} ms   {faster}")
    write_results("bench_prefill", rows)
    if args.by_module or args.dry_run:
        ids = torch.randint(1, model.tokenizer.vocab_size, (1, 24 if args.dry_run else 128)).to(device)
        print_ops_by_module(ops_by_module(model, prefill_fn(model, model.new_cache(), ids)), config.num_layers)
    if args.dry_run:
        diff = check_against_rectangle(model)
        print(f"{'PASS' if diff <= 1e-4 else 'FAIL'}: the packed prefill's last logits against the rectangle forward's, "
              f"max |diff| {diff:.2g} (fp32, tolerance 1e-4)")
        if diff > 1e-4:
            raise SystemExit(1)


def check_against_rectangle(model) -> float:
    """Max |diff| of the benchmarked step's last-token logits against ``model(ids, cache=...)`` per sequence."""
    ids = torch.randint(1, model.tokenizer.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        packed = prefill_fn(model, model.new_cache(), ids)()
        cache = model.new_cache()
        rect = torch.stack([model(ids[i:i + 1], cache=cache, seq_ids=[cache.add_sequence()])[0, -1] for i in range(2)])
    return (packed.float() - rect).abs().max().item()


if __name__ == "__main__":
    main()
