"""Training throughput: the reference no-cache forward + backward, the lean training path and a plain dense
pre-norm transformer of the same width and depth, in one run.

    python benchmarks/bench_training.py                           # GPU: laptop config, batch 32 x 1024
    python benchmarks/bench_training.py --device cpu --tiny       # dry run on a CPU (seconds)

Variants (each a forward + backward of a full next-token loss over every position, no optimizer step):
  reference  MiniDSA.forward (per-query gathers, offline FP8 experts dequantised each forward; experts are buffers)
  lean       TrainingModel: masked SDPA over the selected keys, matmul-only KDA chunks, grouped float experts
  lean_kl    lean + the indexer's sparse-stage KL (training/indexer_losses.layer_kl), i.e. a real training step
  dense      pre-norm transformer, same width/depth/heads, causal SDPA, SwiGLU 4d
Prints tokens/s and peak memory per variant, and the loss of reference vs lean on the same batch. On a GPU
the peak is torch.cuda.max_memory_allocated during the timed steps; on a CPU each variant runs in its own
process and the peak is that process's maximum resident set size.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import minidsa
from minidsa.training import tasks
from minidsa.training.forward import TrainingModel
from minidsa.training.indexer_losses import layer_kl

VARIANTS = ("reference", "lean", "lean_kl", "dense")


class DenseBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate_up, self.down = nn.Linear(d, 8 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d))
        g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class DensePeer(nn.Module):
    """Pre-norm transformer: embedding, blocks, final RMSNorm, head (untied)."""

    def __init__(self, cfg: minidsa.ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.blocks = nn.ModuleList(DenseBlock(d, cfg.mla.num_heads) for _ in range(cfg.num_layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def make_step(variant: str, cfg, device):
    """-> (step() running forward + backward and returning the loss, the module)."""
    if variant == "dense":
        peer = DensePeer(cfg).to(device)
        return lambda ids: _backward(lm_loss(peer(ids), ids)), peer
    model = minidsa.MiniDSA(cfg, device=device)
    if variant == "reference":
        # Offline experts: every expert converted to FP8 once, not once per layer and forward. Under autograd
        # the dispatcher runs the references (the kernels have no backward), so this is the plain-torch model.
        model.set_expert_mode("offline")
        return lambda ids: _backward(lm_loss(model(ids), ids)), model
    tm = TrainingModel(model)

    def step(ids):
        logits, recorded = tm(ids, record=variant == "lean_kl")
        loss = lm_loss(logits, ids)
        if recorded:
            loss = loss + torch.stack([layer_kl(m, x, "sparse") for m, x in recorded.items()]).mean()
        return _backward(loss)

    return step, tm


def _backward(loss: torch.Tensor) -> float:
    loss.backward()
    return loss.detach()


def batch(cfg, args, device) -> torch.Tensor:
    return tasks.encode(tasks.samples("retrieval", "train", 0, 0, args.batch, args.context), cfg).input_ids.to(device)


def run_variant(variant: str, args) -> dict:
    cfg, device = minidsa.load_config(args.config), torch.device(args.device)
    ids = batch(cfg, args, device)
    step, module = make_step(variant, cfg, device)
    for _ in range(args.warmup):
        step(ids)
        module.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(ids)
        module.zero_grad(set_to_none=True)
    float(loss)  # waits for the device
    elapsed = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"variant": variant, "tokens_per_s": args.batch * args.context * args.steps / elapsed,
            "step_s": elapsed / args.steps, "peak_gib": peak / 2**30, "loss": float(loss)}


def loss_check(args) -> tuple[float, float]:
    """Reference and lean loss on the same batch, same weights (no backward)."""
    cfg, device = minidsa.load_config(args.config), torch.device(args.device)
    model = minidsa.MiniDSA(cfg, device=device)
    ids = batch(cfg, args, device)[: min(args.batch, 4)]
    with torch.no_grad():
        return float(lm_loss(model(ids), ids)), float(lm_loss(TrainingModel(model)(ids)[0], ids))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="laptop")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocator, kernels)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="dry run: tiny config, batch 2 x 128, 2 steps")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one variant in this process
    args = p.parse_args()
    if args.tiny:
        args.config, args.batch, args.context, args.steps, args.warmup = "tiny", 2, 128, 2, 1
    torch.manual_seed(0)
    if args.only:
        print(json.dumps(run_variant(args.only, args)))
        return
    ref, lean = loss_check(args)
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the variants run in child processes: give them this process's cached memory
    print(f"{args.config}, batch {args.batch} x {args.context}, {args.device}: loss reference {ref:.6f}, "
          f"lean {lean:.6f}, |diff| {abs(ref - lean):.2e}")
    rows = []
    for v in args.variants.split(","):
        # each variant in its own process: the peak (ru_maxrss on a CPU, max_memory_allocated on a GPU) is
        # then that variant's alone, and one that runs out of memory does not take the others with it
        cmd = [sys.executable, __file__, *sys.argv[1:], "--only", v]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{v:10s} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:160]}", flush=True)
            continue
        rows.append(json.loads(done.stdout.splitlines()[-1]))
        r = rows[-1]
        print(f"{v:10s} {r['tokens_per_s']:>12,.0f} tokens/s  {r['step_s'] * 1e3:9.1f} ms/step  "
              f"peak {r['peak_gib']:7.2f} GiB  loss {r['loss']:.4f}", flush=True)
    base = {r["variant"]: r for r in rows}
    if "reference" in base and "lean" in base:
        print(f"lean vs reference: {base['lean']['tokens_per_s'] / base['reference']['tokens_per_s']:.1f}x tokens/s, "
              f"{base['lean']['peak_gib'] / base['reference']['peak_gib']:.2f}x peak memory")


if __name__ == "__main__":
    main()
