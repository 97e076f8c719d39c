"""Training signal of the DSA lightning indexer (docs/design.md §2).

The indexer learns to predict where the main attention looks: the target p[t, :] is the main
attention's probabilities (each head's softmax) summed over heads and L1-normalised; the loss is
KL(p || softmax(I[t, :])).

* Warm-up stage: attention is dense (all causal keys) and only the indexer learns.
* Sparse stage: the KL is taken over the selected keys only, and the indexer's input is detached, so
  the indexer learns from this loss alone while the rest of the model learns from the LM loss. The
  target is the main attention's own distribution over the selected keys: each head's softmax over
  those keys alone, then summed and normalised (Megatron's compute_dsa_indexer_loss), not the dense
  distribution cut down to them, which would weight the heads differently.

``focus_loss`` is the optional sparse-stage term for the main model (not the indexer): minus the log of
each head's dense attention mass on the selected keys.

    loss = indexer_kl_loss(model, input_ids, stage="warmup")
    loss.backward()   # gradients reach only the indexer parameters
"""

from __future__ import annotations

import torch

from .. import ops
from ..model.minidsa import MiniDSA
from ..model.mla import GatedMLA
from ..ops import acc_dtype


def _capture_mla_inputs(model: MiniDSA, input_ids: torch.Tensor, dense: bool) -> dict[GatedMLA, torch.Tensor]:
    """Run one no-cache forward and keep each MLA layer's (normalised) input x [B, T, d]; with ``dense``
    the model attends to every causal key (the warm-up stage's forward)."""
    seen: dict[GatedMLA, torch.Tensor] = {}
    layers = [m for m in model.modules() if isinstance(m, GatedMLA)]
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.__setitem__(mod, args[0])) for m in layers]
    topks = [m.indexer.topk for m in layers]
    try:
        if dense:
            for m in layers:
                m.indexer.topk = input_ids.shape[1]  # top-k of all causal keys = dense attention
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
        for m, k in zip(layers, topks):
            m.indexer.topk = k
    return seen


def attention_target(mla: GatedMLA, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The KL target p [B, T, S]: the main attention's own distribution over the kept keys (``keep`` bool
    [B, T, S]: causal, and in the sparse stage also selected), i.e. each head's softmax over those keys,
    summed over heads and L1-normalised, as Megatron's compute_dsa_indexer_loss builds it."""
    with torch.no_grad():
        p = mla._project(x)
        k, _ = mla.decompress(p["kv_latent"], p["k_pe"])
        acc = acc_dtype(p["q"])  # fp32 math, fp64 kept
        s = torch.einsum("bthd,bshd->bhts", p["q"].to(acc), k.to(acc)) * mla.softmax_scale
        probs = torch.softmax(s.masked_fill(~keep.unsqueeze(1), float("-inf")), dim=-1).sum(1)
        return probs / probs.sum(-1, keepdim=True)


def _causal(B: int, T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)


def selected_keys(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """bool [B, T, S]: causal and among query t's top-k indexer ``scores`` [B, T, S] (the sparse stage's keys)."""
    B, T, _ = scores.shape
    sel = ops.topk_indices(scores, topk, torch.arange(T, device=scores.device).expand(B, T))
    return _causal(B, T, scores.device) & ops.indices_to_mask(sel, T)


def focus_loss(mla: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """-log(share of each head's dense attention on the indexer's selected keys), averaged over heads and the
    queries that have more causal keys than top-k. x [B, T, d] is the layer's input; the gradient reaches the
    main model (queries, keys and what feeds x), not the indexer, whose selection is held fixed.

    Not part of DSA: an optional term of the sparse stage (``TrainConfig.focus_loss_weight``). A head the
    output gate has switched off stays near uniform over the context, since nothing trains the keys it
    does not see; this term moves such a head's mass onto the selected keys, so that the sparse and the
    dense attention of the model agree (docs/design.md §2)."""
    B, T, _ = x.shape
    if T <= mla.indexer.topk:  # every query keeps all its keys: nothing lies outside
        return x.new_zeros((), dtype=acc_dtype(x))
    with torch.no_grad():
        scores = ops.index_scores(*_indexer_inputs(mla, x), mla.indexer.softmax_scale, backend="torch")
        keep = selected_keys(scores, mla.indexer.topk).unsqueeze(1)  # [B, 1, T, S]
    p = mla._project(x)
    k, _ = mla.decompress(p["kv_latent"], p["k_pe"])
    acc = acc_dtype(p["q"])
    s = torch.einsum("bthd,bshd->bhts", p["q"].to(acc), k.to(acc)) * mla.softmax_scale
    causal = _causal(B, T, x.device).unsqueeze(1)
    outside = torch.logsumexp(s.masked_fill(~causal, float("-inf")), -1) - torch.logsumexp(
        s.masked_fill(~keep, float("-inf")), -1)  # [B, H, T] = -log(selected mass)
    return outside[:, :, mla.indexer.topk:].mean()


def _indexer_inputs(mla: GatedMLA, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_idx, dequantised k_idx, w_idx) of the indexer for the layer input x; the low-rank query is detached."""
    c_q = mla.q_a_layernorm(mla.q_a_proj(x)).detach()
    q_idx, w_idx = mla.indexer.queries(c_q, x)
    return q_idx, mla.indexer.dequant_keys(mla.indexer.keys(x)), w_idx


def layer_kl(mla: GatedMLA, x: torch.Tensor, stage: str = "warmup") -> torch.Tensor:
    """KL(p || softmax(I)) of one MLA layer, averaged over queries. x [B, T, d] is the layer's input.

    Warm-up: over all causal keys. Sparse: over each query's selected keys only, the indexer's input
    detached; the target is then the attention restricted to those keys (``attention_target``).
    """
    if stage not in ("warmup", "sparse"):
        raise ValueError(f"stage={stage!r}; use 'warmup' or 'sparse'")
    B, T, _ = x.shape
    xi = x.detach() if stage == "sparse" else x  # sparse stage: the indexer's input is detached
    scores = ops.index_scores(*_indexer_inputs(mla, xi), mla.indexer.softmax_scale, backend="torch")  # [B, T, S]
    keep = selected_keys(scores.detach(), mla.indexer.topk) if stage == "sparse" else _causal(B, T, x.device)
    target = attention_target(mla, x, keep)
    log_q = torch.log_softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    kl = torch.where(keep & (target > 0), target * (torch.log(target.clamp_min(1e-30)) - log_q), torch.zeros_like(log_q))
    return kl.sum(-1).mean()


def indexer_kl_loss(model: MiniDSA, input_ids: torch.Tensor, stage: str = "warmup") -> torch.Tensor:
    """Mean over MLA layers of ``layer_kl``. Gradients reach only the indexers' parameters."""
    inputs = _capture_mla_inputs(model, input_ids, dense=stage == "warmup")
    return torch.stack([layer_kl(mla, x, stage) for mla, x in inputs.items()]).mean()
