"""Pictures of Kimi Delta Attention (docs/design.md §5): what its gates do token by token, and why its
memory does not grow with the context.

- ``plot_kda_gates``: per head, the decay alpha = exp(g) (how much of the state each token keeps; near 1 =
  remember, small = forget), the write strength beta (how hard a token overwrites what the state predicts
  for its key) and the Frobenius norm of the recurrent state after each token. A learner sees heads
  specialise (slow heads that keep, fast heads that forget) and the state norm stay bounded, which is
  what the delta rule promises: a write replaces the old value under a key instead of piling up.
- ``plot_state_memory``: bytes one sequence needs for the KDA states (a constant: H x K x V per head plus
  the short-conv tail, per layer) against the MLA KV cache and the indexer keys (linear in the context),
  log-log, from the config's cache layout. This is the reason K3 has three KDA layers per MLA layer.

``kda_gates`` returns the numbers behind the first picture.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from .. import ops
from ..model.kda import KimiDeltaAttention
from ..model.minidsa import MiniDSA
from ._common import as_batch, human_bytes, meta_model, new_axes, token_axis

DEFAULT_CONTEXTS = (1_000, 10_000, 100_000, 1_000_000)


def kda_layer(model: MiniDSA, layer: int | None = None) -> KimiDeltaAttention:
    """The KDA attention of decoder layer ``layer`` (the first KDA layer when None); ValueError otherwise."""
    kda = model.config.kda_layers
    if not kda:
        raise ValueError(f"model {model.config.name!r} has no KDA layer (layer_types {model.config.layer_types})")
    layer = kda[0] if layer is None else layer
    if layer not in kda:
        raise ValueError(f"layer {layer} is not a KDA layer of this model; KDA layers: {kda}")
    return model.language_model.model.layers[layer].self_attn


@torch.no_grad()
def kda_inputs(model: MiniDSA, token_ids, layer: int | None = None) -> dict[str, torch.Tensor]:
    """One no-cache forward of ``token_ids`` with a hook on the KDA layer's input; that input, run through
    the layer's own pieces from a zero state, gives q, k, v, g [1, T, H, K] and beta [1, T, H] exactly as
    the forward computed them (fp32)."""
    attn = kda_layer(model, layer)
    seen = {}
    handle = attn.register_forward_pre_hook(lambda _module, args: seen.setdefault("x", args[0]))
    try:
        model(as_batch(model, token_ids))
    finally:
        handle.remove()
    x = seen["x"]
    conv = torch.zeros(x.shape[0], *attn.state_shapes()["conv"], dtype=ops.acc_dtype(x), device=x.device)
    (q, k, v, g, beta), _ = attn.recurrence_inputs(x, {"conv": conv})
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


@torch.no_grad()
def kda_gates(model: MiniDSA, token_ids, layer: int | None = None) -> dict:
    """{"decay": [T, H] mean over K of alpha = exp(g) (in (0, 1]), "beta": [T, H], "state_norm": [T, H]
    Frobenius norm of each head's recurrent state after each token, "layer": the decoder layer} (numpy).
    The state comes from ``ops.kda_recurrent`` stepped one token at a time from the zero state."""
    layer = model.config.kda_layers[0] if layer is None and model.config.kda_layers else layer
    t = kda_inputs(model, token_ids, layer)
    q, k, v, g, beta = (t[n] for n in ("q", "k", "v", "g", "beta"))
    state, norms = None, []
    for i in range(q.shape[1]):
        _, state = ops.kda_recurrent(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1], beta[:, i:i + 1],
                                     None, state)
        norms.append(torch.linalg.matrix_norm(state[0]))  # [H]: Frobenius over K x V
    return {"decay": g[0].exp().mean(-1).cpu().numpy(), "beta": beta[0].cpu().numpy(),
            "state_norm": torch.stack(norms).cpu().numpy(), "layer": layer}


def _head_lines(ax, values: np.ndarray, title: str, ylabel: str) -> None:
    """One line per head over token positions, legend "head h"."""
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, values.shape[1]))
    for h in range(values.shape[1]):
        ax.plot(np.arange(values.shape[0]), values[:, h], lw=1, marker=".", ms=3, color=colours[h], label=f"head {h}")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=min(4, values.shape[1]), loc="best")
    ax.grid(alpha=0.3)


def plot_kda_gates(model: MiniDSA, token_ids, layer: int | None = None, *, fig=None, label_every: int | None = None):
    """Three panels over the tokens (token labels on the shared x axis): decay alpha per head, beta per head
    and the recurrent state's norm per head."""
    data = kda_gates(model, token_ids, layer)
    ids = as_batch(model, token_ids)[0].cpu()
    fig = fig or plt.figure(figsize=(max(7.0, 0.16 * ids.numel() + 2), 8))
    axes = fig.subplots(3, 1, sharex=True)
    _head_lines(axes[0], data["decay"], "decay alpha = exp(g), mean over key channels (1 = keep the state)",
                "alpha")
    axes[0].set_ylim(0, 1.05)
    _head_lines(axes[1], data["beta"], "write strength beta (delta-rule step size)", "beta")
    axes[1].set_ylim(0, 1.05)
    _head_lines(axes[2], data["state_norm"], "recurrent state norm ||S||_F after each token", "||S||_F")
    token_axis(axes[2], ids, "x", label_every)
    axes[2].set_xlabel("token")
    fig.suptitle(f"KDA gates, decoder layer {data['layer']} ({model.config.name})")
    fig.tight_layout()
    return fig


def state_memory(config="k3.1-pro", contexts=DEFAULT_CONTEXTS) -> dict[str, np.ndarray]:
    """Bytes per sequence at each context: {"context", "kv_cache" (MLA latent + k_pe planes), "indexer_keys"
    (the indexer-key planes), "kda_state" (constant)}, from the config's cache layout."""
    layout = meta_model(config).cache_layout()
    ctx = np.asarray(contexts, dtype=np.float64)
    per_plane = {p.name: layout.num_layers * p.width * torch.empty((), dtype=p.dtype).element_size()
                 for p in layout.planes}
    index = sum(b for n, b in per_plane.items() if n.startswith("index"))
    kv = sum(per_plane.values()) - index
    return {"context": ctx, "kv_cache": kv * ctx, "indexer_keys": index * ctx,
            "kda_state": np.full_like(ctx, float(layout.state_bytes_per_sequence()))}


def plot_state_memory(config="k3.1-pro", contexts=DEFAULT_CONTEXTS, *, ax=None):
    """Log-log bytes per sequence against context length: KDA state (flat) vs MLA KV and indexer keys (linear);
    the context where the KV cache overtakes the KDA states is marked."""
    data = state_memory(config, contexts)
    fig, ax = new_axes(ax, (7, 4.5))
    ctx = data["context"]
    for key, label, style in (("kv_cache", "MLA KV cache (latent c_kv + k_pe), all MLA layers", "o-"),
                              ("indexer_keys", "DSA indexer keys k_I, all MLA layers", "s-"),
                              ("kda_state", "KDA state (recurrent + short conv), all KDA layers", "^-")):
        ax.plot(ctx, data[key], style, label=label)
        ax.annotate(human_bytes(data[key][-1]), (ctx[-1], data[key][-1]), textcoords="offset points",
                    xytext=(4, 0), fontsize=8, va="center")
    per_token = data["kv_cache"][0] / ctx[0]
    cross = data["kda_state"][0] / per_token
    if ctx[0] <= cross <= ctx[-1]:
        ax.axvline(cross, ls=":", color="0.4", label=f"KV cache = KDA state at {cross:,.0f} tokens")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(ctx[0] / 1.5, ctx[-1] * 4)  # room for the labels at the right end
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("bytes per sequence")
    name = meta_model(config).config.name
    ax.set_title(f"{name}: per-sequence memory, KDA state vs MLA KV cache")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


__all__ = ["kda_gates", "plot_kda_gates", "plot_state_memory", "state_memory"]
