"""RMSNorm kernel (minidsa/ops/norm/rms_triton.py) on the GPU: time, reference, peer, % of HBM bandwidth.

    PYTHONPATH=. python benchmarks/bench_norm.py            # GPU
    PYTHONPATH=. python benchmarks/bench_norm.py --dry-run  # CPU, tiny shapes, Triton interpreter

Shapes: the `small` config's decoder norms over a 4,096-token prefill ([4096, 1024] bf16), its MoE latent norm
([4096, 512]), and a decode step of 64 rows ([64, 1024]). The kernel moves x in and y out (both bf16) plus the
fp32 weight. Reference: the op's plain form (x to fp32, F.rms_norm, back to bf16: three launches). Peer:
torch's F.rms_norm on the bf16 tensor with a bf16 weight, one call, as a plain bf16 model would norm. With $OUT
set, results also go to $OUT/bench_norm.json.
"""

from __future__ import annotations

import os
import sys

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _bench import pick_device, timer, warm_up, write_results  # noqa: E402

from minidsa.ops.norm.reference import rms_norm_ref  # noqa: E402


def hbm_bytes_per_s(dev: str) -> tuple[float, str]:
    """The bandwidth the % column divides by: the H200's measured copy rate (docs/design.md §11), else the
    H100 SXM's data-sheet 3.35 TB/s."""
    if dev == "cuda" and "H200" in torch.cuda.get_device_name():
        return 4.3e12, "4.3 TB/s"
    return 3.35e12, "3.35 TB/s"


def main() -> int:
    dev = pick_device("bench_norm", DRY)
    if dev is None:
        return 0
    from minidsa.ops.norm import rms_triton as kern
    warm_up(dev)
    run = timer(dev)
    hbm, hbm_name = hbm_bytes_per_s(dev)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter: fp32 (no bf16 arithmetic)
    shapes = [(4096, 1024), (4096, 512), (64, 1024)] if not DRY else [(5, 60), (3, 128)]
    g = torch.Generator().manual_seed(0)
    ok, rows = True, []
    for n, d in shapes:
        x = (torch.randn(n, d, generator=g) * 3).to(dev, dtype)
        w = (1 + 0.1 * torch.randn(d, generator=g)).to(dev)
        w_low = w.to(dtype)
        t_k = run(lambda: kern.rms_norm(x, w, 1e-5))
        t_r = run(lambda: rms_norm_ref(x, w, 1e-5))
        t_p = run(lambda: F.rms_norm(x, (d,), w_low, 1e-5))
        nbytes = 2 * x.numel() * x.element_size() + w.numel() * 4
        got, want = kern.rms_norm(x, w, 1e-5).float(), rms_norm_ref(x, w, 1e-5).float()
        # one rounding to x's dtype at most apart (the mean summed in another order)
        ulp = want.abs().clamp_min(1e-30) * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20)
        good = bool(((got - want).abs() <= ulp).all())
        ok &= good
        print(f"RMSNorm [{n}, {d}] {str(dtype)[6:]} ({dev}): kernel {t_k * 1e6:8.1f} us "
              f"({nbytes / t_k / hbm * 100:5.1f} % of {hbm_name}), reference {t_r * 1e6:8.1f} us "
              f"({t_r / t_k:4.1f}x), peer F.rms_norm in {str(dtype)[6:]} {t_p * 1e6:8.1f} us ({t_p / t_k:4.1f}x): "
              f"{'PASS' if good else 'FAIL'}")
        rows.append({"rows": n, "dim": d, "kernel_s": t_k, "reference_s": t_r, "peer_s": t_p, "agree": good})
    write_results("bench_norm", {"shapes": rows})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
