"""Small helpers shared by the pictures of kda, moe, mxfp4, cache, budget and training: token inputs as a
batch of one, the meta-device model of a config (sizes at reference scale without memory), byte labels,
and a fresh figure or the caller's Axes.
"""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from ..checkpoint.manifest import resolve_config
from ..config import ModelConfig
from ..model.minidsa import MiniDSA
from ..model.trace import GenerationTrace
from .tokens import token_labels

_META: dict[str, MiniDSA] = {}  # config JSON -> its meta-device model (building k3.1-pro takes seconds)


def as_batch(model: MiniDSA, token_ids) -> torch.Tensor:
    """Token ids as int64 [1, T]: a str (encoded with the model's tokenizer, bos first), a list of ints,
    a 1-D or [1, T] tensor, or a GenerationTrace (its token ids)."""
    if isinstance(token_ids, GenerationTrace):
        token_ids = token_ids.token_ids
    if isinstance(token_ids, str):
        token_ids = model.tokenizer.encode(token_ids)
    ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"token_ids must be one non-empty sequence (a str, a list or a [T] / [1, T] tensor), "
                         f"got shape {tuple(ids.shape)}")
    return ids.unsqueeze(0).to(model.device)


def meta_model(config) -> MiniDSA:
    """The model of ``config`` (a preset or shipped-checkpoint name, a JSON path, a ModelConfig or a MiniDSA)
    built on the meta device: every shape and dtype, no memory. Cached per config."""
    cfg = config.config if isinstance(config, MiniDSA) else config
    cfg = cfg if isinstance(cfg, ModelConfig) else resolve_config(cfg)
    key = json.dumps(cfg.to_dict(), sort_keys=True)
    if key not in _META:
        _META[key] = MiniDSA(cfg, device="meta", init=False)
    return _META[key]


UNITS = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "kB": 1e3}


def human_bytes(n: float, unit: str | None = None) -> str:
    """Bytes in decimal units: 512 B, 3.1 kB, 4.36 GB, 1.45 TB; ``unit`` ("GB", ...) fixes the unit."""
    if unit is not None:
        return f"{n / UNITS[unit]:,.{3 if n < UNITS[unit] else 1}f} {unit}".replace(".0 ", " ")
    for name, size in UNITS.items():
        if abs(n) >= size:
            return f"{n / size:.3g} {name}"
    return f"{n:.0f} B"


def new_axes(ax=None, figsize=(7, 4)):
    """(figure, axes): the caller's Axes and its figure, or a new figure with one Axes."""
    if ax is not None:
        return ax.figure, ax
    fig = plt.figure(figsize=figsize)
    return fig, fig.add_subplot()


def token_axis(ax, ids: torch.Tensor, axis: str = "x", every: int | None = None) -> None:
    """Token labels as the ticks of ``axis`` (every ``every``-th, automatic when None: at most ~48 labels)."""
    labels = token_labels(ids.reshape(-1).tolist())
    step = every or max(1, -(-len(labels) // 48))
    pos = list(range(0, len(labels), step))
    setter = ax.set_xticks if axis == "x" else ax.set_yticks
    setter(pos, [labels[p] for p in pos], fontsize=7, fontfamily="monospace")


def integer_axis(ax, axis: str = "x") -> None:
    """Integer ticks only on a discrete axis."""
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))


def bytes_axis(ax, axis: str = "x", label: str = "bytes (decimal units: 1 GB = 10^9 B)", unit: str | None = None) -> None:
    """Tick labels of a bytes axis in kB / MB / GB / TB (or all in ``unit``)."""
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_formatter(FuncFormatter(lambda v, _pos: human_bytes(v, unit) if v else "0"))
    (ax.set_xlabel if axis == "x" else ax.set_ylabel)(label)
