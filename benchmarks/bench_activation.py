"""SiTU-GLU forward and backward kernels (minidsa/ops/activation/situ_glu_triton.py) on the H200: time, reference,
peer, % of HBM bandwidth.

    PYTHONPATH=. python benchmarks/bench_activation.py            # GPU
    PYTHONPATH=. python benchmarks/bench_activation.py --dry-run  # CPU, tiny shapes, Triton interpreter

Shape: the shared experts of the laptop config at batch 32 x 1024 (32,768 tokens x 512, fp32), the
largest SiTU-GLU tensors of a training step. Forward moves 3 tensors (g, u in, h out), backward 5
(g, u, dLoss/dh in, two gradients out). Peer: autograd through the plain torch expression (what the
training step did before the op existed), timed as forward + backward. With $OUT set, results also go to
$OUT/bench_activation.json.
"""

from __future__ import annotations

import os
import sys

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402
from _bench import pick_device, timer, warm_up, write_results  # noqa: E402

from minidsa.ops.activation import reference as ref  # noqa: E402

HBM = 4.3e12  # bytes/s, measured H200 copy bandwidth (docs/design.md §11)
BG, BU = 4.0, 25.0


def main() -> int:
    dev = pick_device("bench_activation", DRY)
    if dev is None:
        return 0
    from minidsa.ops.activation import situ_glu_triton as kern
    warm_up(dev)
    run = timer(dev)
    N, F = (32768, 512) if not DRY else (8, 96)
    g = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(N, F, generator=g).to(dev) * s for s in (3.0, 10.0, 1.0))
    nbytes = N * F * 4

    def peer():
        a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
        ref.situ_glu_values(a, b, BG, BU).backward(grad)

    t_fwd = run(lambda: kern.situ_glu(gate, up, BG, BU))
    t_bwd = run(lambda: kern.situ_glu_backward(gate, up, grad, BG, BU))
    t_ref = run(lambda: ref.situ_glu_backward_ref(gate, up, grad, BG, BU))
    t_peer = run(peer)
    err = max(float((a - b).abs().max()) for a, b in zip(kern.situ_glu_backward(gate, up, grad, BG, BU),
                                                            ref.situ_glu_backward_ref(gate, up, grad, BG, BU)))
    print(f"SiTU-GLU on [{N}, {F}] fp32 ({dev})")
    print(f"  forward kernel      {t_fwd * 1e6:9.1f} us  {3 * nbytes / t_fwd / HBM * 100:5.1f} % of 4.3 TB/s")
    print(f"  backward kernel     {t_bwd * 1e6:9.1f} us  {5 * nbytes / t_bwd / HBM * 100:5.1f} % of 4.3 TB/s")
    print(f"  backward reference  {t_ref * 1e6:9.1f} us  -> kernel {t_ref / t_bwd:5.1f}x faster")
    print(f"  peer: autograd through the expression, forward + backward {t_peer * 1e6:9.1f} us  "
          f"-> kernels {t_peer / (t_fwd + t_bwd):5.2f}x faster")
    ok = err <= 1e-5 * max(1.0, float(grad.abs().max()) * BU)
    print(f"  max |kernel - reference| of the gradients {err:.2e}: {'PASS' if ok else 'FAIL'}")
    write_results("bench_activation", {"N": N, "F": F, "forward_s": t_fwd, "backward_s": t_bwd,
                                       "reference_backward_s": t_ref, "peer_s": t_peer, "max_err": err})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
