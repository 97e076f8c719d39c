"""Pictures of the MXFP4 format of the routed experts (docs/design.md §7): what 4 bits can hold, what the
round trip costs in accuracy, and what it saves in bytes.

- ``plot_mxfp4_values``: the 16 E2M1 codes (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4,
  6 and their negatives) and the values one 32-element block holds at a few E8M0 scales 2^s. A learner
  sees that the grid is coarse and uneven (relative steps of 1/3 .. 1/7) and that the shared power-of-two
  scale slides the whole grid, so one large element decides the resolution of its 31 neighbours.
- ``plot_quantisation_error``: histogram of the relative error |dequantize(quantize(w)) - w| / |w| of a
  tensor: most elements land within the grid's half step, small elements of a block with a large one
  round to 0 (relative error 1).
- ``plot_format_bytes``: bytes of all routed experts of a config in MXFP4 (0.5 byte per element + one
  scale byte per 32), FP8 (1 byte + the same scales: the form the workspace computes in) and bf16.

``relative_error`` and ``expert_format_bytes`` return the numbers behind the last two pictures.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from ..formats import mxfp4
from ._common import bytes_axis, human_bytes, meta_model, new_axes


def plot_mxfp4_values(*, scales=(-1, 0, 1), ax=None):
    """The 16 E2M1 code values (each 4-bit code written above its value at scale 2^0) and the grid of one
    block at each E8M0 scale 2^s in ``scales``, one row per scale, on a linear value axis."""
    table = mxfp4.e2m1_table(torch.float32).tolist()
    fig, ax = new_axes(ax, (10, 1.6 + 1.0 * len(scales)))
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.85, len(scales)))
    for row, (s, colour) in enumerate(zip(scales, colours)):
        values = np.asarray(table) * 2.0 ** s
        ax.scatter(values, np.full(16, row), s=22, color=colour, edgecolor="black", lw=0.4, zorder=3,
                   label=f"scale 2^{s} (E8M0 code {s + mxfp4.E8M0_BIAS}): smallest nonzero {0.5 * 2.0 ** s:g}, "
                         f"largest ±{6 * 2.0 ** s:g}")
        if s == 0:
            for code, v in enumerate(table):
                if code != 8:  # -0 (1000) sits on +0 (0000)
                    ax.annotate("0000\n1000" if code == 0 else f"{code:04b}", (v, row), xytext=(0, 8),
                                textcoords="offset points", ha="center", va="bottom", fontsize=6, rotation=90,
                                fontfamily="monospace")
    ax.set_yticks(range(len(scales)), [f"2^{s}" for s in scales])
    ax.set_ylim(-0.6, len(scales) - 0.1)
    ax.set_ylabel("block scale (E8M0)")
    ax.set_xlabel("value = E2M1 code value x block scale")
    ax.set_title("The 16 E2M1 codes (sign | 2-bit exponent | 1-bit mantissa) and what one 32-element block holds")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=1)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def round_trip(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w as fp32, its MXFP4 round trip) with the same shape. Blocks of 32 run along the last dim when it is a
    multiple of 32 (as in the model's expert matrices); otherwise along the flattened tensor, zero-padded."""
    w = torch.as_tensor(w).detach().float().cpu()
    if w.dim() >= 1 and w.shape[-1] % mxfp4.GROUP == 0:
        return w, mxfp4.dequantize(*mxfp4.quantize(w))
    flat = w.reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % mxfp4.GROUP)])  # zeros do not change a block's max
    return w, mxfp4.dequantize(*mxfp4.quantize(padded))[: flat.numel()].reshape(w.shape)


def relative_error(w) -> np.ndarray:
    """|dequantize(quantize(w)) - w| / |w| of every nonzero element of ``w`` (flat, float64; exact zeros
    are exactly representable and left out)."""
    w, back = round_trip(w)
    w, back = w.reshape(-1).double(), back.reshape(-1).double()
    nonzero = w != 0
    return ((back[nonzero] - w[nonzero]).abs() / w[nonzero].abs()).numpy()


def plot_quantisation_error(w, *, bins: int = 50, ax=None):
    """Histogram of ``relative_error(w)`` on [0, 1], the median and the worst case marked."""
    err = relative_error(w)
    if err.size == 0:
        raise ValueError("w has no nonzero element: there is no relative error to draw")
    fig, ax = new_axes(ax, (7, 4))
    exact = int((err == 0).sum())
    ax.hist(np.clip(err, 0, 1), bins=bins, range=(0, 1), color="tab:blue",
            label=f"elements ({exact} of {err.size} exact)")
    ax.axvline(float(np.median(err)), color="tab:orange", ls="--", label=f"median {np.median(err):.3g}")
    ax.axvline(float(err.max()), color="tab:red", ls=":", label=f"worst {err.max():.3g}")
    ax.set_yscale("log")
    ax.set_xlabel("relative error |MXFP4(w) - w| / |w|")
    ax.set_ylabel("elements (log scale)")
    ax.set_title(f"MXFP4 round-trip error of a {'x'.join(map(str, np.shape(w))) or 'scalar'} tensor")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def expert_format_bytes(config="k3.1-pro") -> dict[str, float]:
    """Bytes of every routed expert of ``config`` (all MoE layers): {"elements" (expert weight count),
    "scales" (E8M0 bytes, one per 32 elements), "mxfp4" (codes 0.5 B each + scales), "fp8" (1 B each + the
    same scales), "bf16" (2 B each)}, from the meta-device model's packed buffers."""
    moes = meta_model(config).moe_layers()
    codes = sum(m.experts.packed.numel() for m in moes)  # bytes: two E2M1 codes per byte
    scales = sum(m.experts.scales.numel() for m in moes)
    elements = 2 * codes
    return {"elements": float(elements), "scales": float(scales), "mxfp4": float(codes + scales),
            "fp8": float(elements + scales), "bf16": float(2 * elements)}


def plot_format_bytes(config="k3.1-pro", *, unit: str | None = "GB", ax=None):
    """Stacked bars per format (MXFP4, FP8, bf16) of the routed experts: element bytes and scale bytes,
    totals labelled in ``unit`` ("GB"; None = the unit that fits each number)."""
    b = expert_format_bytes(config)
    fig, ax = new_axes(ax, (6.5, 4))
    names = ["MXFP4\n(4-bit E2M1 + E8M0)", "FP8 e4m3\n(+ the same scales)", "bf16"]
    element_bytes = [b["elements"] / 2, b["elements"], 2 * b["elements"]]
    scale_bytes = [b["scales"], b["scales"], 0.0]
    x = np.arange(3)
    ax.bar(x, element_bytes, color="tab:blue", label="element bytes")
    ax.bar(x, scale_bytes, bottom=element_bytes, color="tab:orange", label="E8M0 scale bytes (1 per 32 elements)")
    for xi, total in zip(x, (b["mxfp4"], b["fp8"], b["bf16"])):
        ax.text(xi, total, human_bytes(total, unit), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, names)
    ax.set_ylim(0, 1.15 * b["bf16"])
    bytes_axis(ax, "y", unit=unit)
    name = meta_model(config).config.name
    ax.set_title(f"{name}: routed experts ({b['elements']:.3g} weights)\nby storage format")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


__all__ = ["expert_format_bytes", "plot_format_bytes", "plot_mxfp4_values", "plot_quantisation_error",
           "relative_error", "round_trip"]
