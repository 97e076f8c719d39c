"""Host synchronisations per cached decode step on a CUDA device, and one decode step captured in a
CUDA graph and replayed to the same logits (docs/design.md §14).

    PYTHONPATH=. python benchmarks/diagnostics/decode_sync_gpu.py [--config laptop] [--batch 4] [--graph]

Counts the warnings of ``torch.cuda.set_sync_debug_mode("warn")`` (every op that makes the host wait
for the device) during one ``model(ids, cache=..., seq_ids=...)`` decode step, and separately during
the part a graph would capture (the forward on a prepared CacheContext). Works on any version of
the package that has ``model(ids, cache=, seq_ids=)``; ``--graph`` needs CacheContext.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import minidsa


def count_syncs(fn) -> tuple[int, object]:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught), out


def prefill(model, cache, batch, gen):
    sids = [cache.add_sequence() for _ in range(batch)]
    with torch.inference_mode():
        for b, sid in enumerate(sids):
            ids = torch.randint(0, 256, (1, 20 + 13 * b), generator=gen).to("cuda")
            model(ids, cache=cache, seq_ids=[sid])
    return sids


def graph_check(model, cache, sids, gen) -> None:
    """Capture one decode step on a prepared context, replay it, compare with the eager step."""
    ids = torch.randint(0, 256, (len(sids), 1), generator=gen).to("cuda")
    ctx = cache.prepare(sids, 1, "cuda")
    lm = model.language_model

    def step():  # everything of model.forward between preparing the context and publishing it
        with minidsa.ops.use_backend(model.backend):
            return lm.lm_head(lm.model(lm.model.embed_tokens(ids), ctx, None)).float()

    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        n, eager = count_syncs(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step()
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(static, eager)
        t0 = time.perf_counter()
        for _ in range(50):
            step()
        torch.cuda.synchronize()
        t_eager = (time.perf_counter() - t0) / 50
        t0 = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        t_graph = (time.perf_counter() - t0) / 50
    print(f"syncs in the graph-capturable part of the step: {n}")
    print(f"CUDA graph: captured one decode step (batch {len(sids)}); replay equals eager bitwise: {same}; "
          f"max |diff| {(static - eager).abs().max().item():.2e}")
    print(f"decode step time: eager {t_eager * 1e3:.2f} ms, graph replay {t_graph * 1e3:.2f} ms "
          f"({t_eager / t_graph:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="laptop")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--graph", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    model = minidsa.MiniDSA(minidsa.load_config(args.config), device="cuda")
    cache = model.new_cache()
    sids = prefill(model, cache, args.batch, gen)
    ids = torch.randint(0, 256, (args.batch, 1), generator=gen).to("cuda")
    with torch.inference_mode():
        model(ids, cache=cache, seq_ids=sids)  # warm-up (workspace allocation, caches)
        n, _ = count_syncs(lambda: model(ids, cache=cache, seq_ids=sids))
    print(f"{minidsa.__file__}: {args.config}, batch {args.batch}: {n} host syncs in one decode step "
          f"(model(ids, cache=, seq_ids=), context preparation included)")
    if args.graph:
        graph_check(model, cache, sids, gen)


if __name__ == "__main__":
    main()
