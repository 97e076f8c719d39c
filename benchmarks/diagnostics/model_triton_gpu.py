"""The whole model on the GPU through the Triton kernels vs the PyTorch references (docs/design.md §12).

    PYTHONPATH=. python benchmarks/diagnostics/model_triton_gpu.py [--config small] [--batches 1 32] [--steps 32]

For each batch size: the same seeded prompts are prefilled into two caches, one per backend, then
``--steps`` cached decode steps run on each. Printed: decode tokens/s per backend and their ratio,
eager (what ``model(...)`` costs, host launch overhead included: a small model's step is hundreds of
launches) and with one decode step captured in a CUDA graph and replayed (the GPU work alone, which
is what a serving loop that replays graphs pays), prefill time, and how far the logits of the two
backends are apart. Compared in the config's dtype
(bf16 for small), the logits differ by rounding, and a rounding difference can flip a discrete choice
(a DSA key or an expert near a tie), so the script also reports how many rows pick the same next
token. Two comparisons show the agreement without those flips: the same prompts with every
discrete choice held fixed (the triton run records each DSA selection and each token's routed
experts, the torch run replays them with its own scores and router weights), and a run in fp32.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _bench and the bench_* modules

import torch  # noqa: E402
from _bench import cuda_graph  # noqa: E402

import minidsa  # noqa: E402
from minidsa.model.indexer import LightningIndexer  # noqa: E402
from minidsa.model.moe import LatentMoE  # noqa: E402


def prompts(batch: int, vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (1, 96 + 37 * b % 160), generator=gen) for b in range(batch)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(model, batch_prompts, steps: int, device: str, graph: bool = True) -> dict:
    """Prefill every prompt, then decode ``steps`` greedy tokens for the whole batch (after the compared
    first step and, when steps > 0, 8 untimed ones)."""
    cache = model.new_cache()
    sids = [cache.add_sequence() for _ in batch_prompts]
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        for p, sid in zip(batch_prompts, sids):
            model(p.to(device), cache=cache, seq_ids=[sid])
        sync(device)
        t_prefill = time.perf_counter() - t0
        ids = torch.full((len(sids), 1), 5, device=device)  # the same input for both backends
        first = model(ids, cache=cache, seq_ids=sids)[:, -1]  # warm-up step, and the compared logits
        ids = first.argmax(-1, keepdim=True)
        # untimed: kernel variants that a growing context specialises on compile here
        for _ in range(8 if steps else 0):
            ids = model(ids, cache=cache, seq_ids=sids)[:, -1].argmax(-1, keepdim=True)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            ids = model(ids, cache=cache, seq_ids=sids)[:, -1].argmax(-1, keepdim=True)
        sync(device)
        t_decode = time.perf_counter() - t0
    return {"prefill_s": t_prefill, "decode_s": t_decode, "first": first.float().cpu(),
            "graph_s": graph_step_s(model, cache, sids, device) if device == "cuda" and graph else float("nan")}


def graph_step_s(model, cache, sids, device: str, reps: int = 20) -> float:
    """Seconds per decode step replayed from a CUDA graph (the step of benchmarks/diagnostics/decode_sync_gpu.py:
    the forward on a prepared context; replays rewrite the same cache rows, which is fine for timing)."""
    ids = torch.full((len(sids), 1), 5, device=device)
    ctx = cache.prepare(sids, 1, device)
    lm = model.language_model

    def step():
        with minidsa.ops.use_backend(model.backend):
            return lm.lm_head(lm.model(lm.model.embed_tokens(ids), ctx, None))

    with torch.inference_mode():
        graph = cuda_graph(step, warmups=2)
        graph.replay()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        sync(device)
    return (time.perf_counter() - t0) / reps


@contextmanager
def held_choices(log: list, replay: bool):
    """Record (replay=False) or replay every DSA selection and every routed-expert choice, in call order.
    A replayed route keeps its own affinities: only which experts is fixed, not their weights."""
    select, select_paged, choose = LightningIndexer.select, LightningIndexer.select_paged, LatentMoE.choose

    def recorded(fn):
        def call(self, *args):
            if replay:
                return log.pop(0)
            log.append(fn(self, *args))
            return log[-1]
        return call

    def choose_held(self, logits):
        if replay:
            ids = log.pop(0)
            return ids, self.route_weights(torch.sigmoid(logits), ids)
        ids, weights = choose(self, logits)
        log.append(ids)
        return ids, weights

    LightningIndexer.select, LightningIndexer.select_paged = recorded(select), recorded(select_paged)
    LatentMoE.choose = choose_held
    try:
        yield
    finally:
        LightningIndexer.select, LightningIndexer.select_paged, LatentMoE.choose = select, select_paged, choose


def held_choice_gap(model, batch_prompts, device: str) -> tuple[float, float]:
    """(max |logit difference|, fraction of rows with the same next token) of the first decode step,
    triton against torch, with the torch run replaying the triton run's discrete choices."""
    log, first = [], {}
    for backend, replay in (("triton", False), ("torch", True)):
        model.set_backend(backend)
        with held_choices(log, replay):
            first[backend] = run(model, batch_prompts, 0, device, graph=False)["first"]
    assert not log, "the replay did not consume every recorded choice"
    a, b = first["torch"], first["triton"]
    return (a - b).abs().max().item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def compare(config: minidsa.ModelConfig, batch: int, steps: int, device: str) -> None:
    model = minidsa.MiniDSA(config, device=device)
    batch_prompts = prompts(batch, config.vocab_size, torch.Generator().manual_seed(batch))
    out = {}
    for backend in ("torch", "triton"):
        model.set_backend(backend)
        run(model, batch_prompts[:1], 2, device)  # compile / warm the kernels
        out[backend] = run(model, batch_prompts, steps, device)
    a, b = out["torch"]["first"], out["triton"]["first"]
    same = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    held, held_same = held_choice_gap(model, batch_prompts, device)
    tps = {k: batch * steps / v["decode_s"] for k, v in out.items()}
    gps = {k: batch / v["graph_s"] for k, v in out.items()}
    print(f"{config.name} {config.dtype} batch {batch}: decode {tps['torch']:.0f} tok/s torch, "
          f"{tps['triton']:.0f} tok/s triton ({tps['triton'] / tps['torch']:.2f}x); in a CUDA graph "
          f"{gps['torch']:.0f} / {gps['triton']:.0f} tok/s ({gps['triton'] / gps['torch']:.2f}x); prefill "
          f"{out['torch']['prefill_s'] * 1e3:.0f} / {out['triton']['prefill_s'] * 1e3:.0f} ms; first decode "
          f"logits max|diff| {(a - b).abs().max().item():.3g} (logit scale {a.abs().max().item():.3g}), "
          f"same next token in {same:.0%} of rows; with the discrete choices held fixed max|diff| {held:.3g}, "
          f"same next token in {held_same:.0%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run in Triton's interpreter (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    config = minidsa.load_config(args.config)
    config = config.replace(max_sequences=max(config.max_sequences, max(args.batches)))
    print(f"kernels registered: {sorted(minidsa.ops.TRITON_KERNELS)}")
    for batch in args.batches:
        compare(config, batch, args.steps, args.device)
    compare(config.replace(dtype="float32"), args.batches[0], 4, args.device)


if __name__ == "__main__":
    main()
