"""Where the time of the tensor-core expert tiles goes at a decode batch (a diagnostic, not a test).

    PYTHONPATH=. python benchmarks/diagnostics/moe_tile_costs.py            # every variant, one process each

The small config's routed experts at 32 tokens (64 experts of 512 x 512 MXFP4, top 8: about 4 tokens an
expert), timed like benchmarks/diagnostics/tune_decode.py (back to back in a CUDA graph, weights overflowing L2). Each
variant takes one piece of work out of the tiles' inner loop, so its saving is that piece's cost; the
variants' results are wrong by construction and only their time is printed:
    shipped       the model's kernels
    one_dot       one bf16 dot per plane instead of the two that carry z's low bits
    no_decode     the packed bytes used as both planes' values (no E2M1 decode, no scales)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _bench and the bench_* modules

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

VARIANTS = ("shipped", "one_dot", "no_decode")


@triton.jit
def _dot_one(w, x_t, acc, DOTS: tl.constexpr):
    return tl.dot(w.to(tl.bfloat16), x_t.to(tl.bfloat16), acc)


@triton.jit
def _planes_no_decode(w_ptr, s, rows, row_ok, K, k0, PTX: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    c = k0 // 2 + tl.arange(0, BK // 2)
    ok = row_ok[:, None] & (c < K // 2)[None, :]
    b = tl.load(w_ptr + rows[:, None] * (K // 2) + c[None, :], mask=ok, other=0).to(tl.bfloat16)
    return b, b


def run(variant: str) -> None:
    from _bench import warm_up
    from bench_moe import BETA_G, BETA_U, make_experts
    from tune_decode import copies, per_call

    from minidsa.ops.moe_experts import mlp_triton as mlp
    if variant == "one_dot":
        mlp._dot = _dot_one
    if variant == "no_decode":
        mlp.weight_planes = _planes_no_decode
    warm_up("cuda")
    L = I = 512
    E, k, N = 64, 8, 32
    gen = torch.Generator("cuda").manual_seed(0)
    n = copies(int(E * 3 * I * L * (0.5 + 1 / 32)))
    layers = [make_experts(E, L, I, "cuda", gen) for _ in range(n)]
    z = torch.randn(N, L, device="cuda", generator=gen)
    ids = torch.rand(N, E, device="cuda", generator=gen).topk(k, dim=1).indices
    experts = torch.arange(E, device="cuda")
    routing = ((ids.unsqueeze(0) == experts.view(-1, 1, 1)) * torch.rand(N, k, device="cuda", generator=gen)).sum(-1)
    us = per_call([lambda p=p: mlp.expert_mlp_mxfp4(z, *p, experts, routing, BETA_G, BETA_U) for p in layers])
    print(f"  {variant:10s} {us:7.2f} us per call (32 tokens, 64 experts, top 8)", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        run(sys.argv[1])
        return
    for v in VARIANTS:  # one process each: a replaced helper must be in place before the kernels compile
        subprocess.run([sys.executable, __file__, v], check=False)


if __name__ == "__main__":
    main()
