"""Evaluation of a (trained) model on held-out seeds of the synthetic tasks (tasks.py): retrieval accuracy
with the indexer's selections and with random ones, the indexer's recall of the dense attention mass per
MLA layer, multimodal accuracy, and both accuracies again with dense attention (docs/design.md §2).

    metrics = evaluate(minidsa.load("runs/tiny"), seed=0, n=64)
    print(format_metrics(metrics))     # one "name: value" line each

A row counts as correct when every answer token (and the closing eos) is the argmax of the teacher-forced
logits, which is exactly when greedy decoding reproduces the answer. ``retrieval_digit_accuracy`` counts the
pass-key digits one by one (chance: 0.1): it shows a model that has learned part of the copy, as a short
run does, where whole-key accuracy is still 0.
"""

from __future__ import annotations

import torch

from ..model.minidsa import MiniDSA
from ..ops import acc_dtype
from . import tasks
from .forward import TrainingModel, indexer_scores
from .indexer_losses import attention_target
from .lean_ops import causal_mask, selection_mask


def evaluate(model: MiniDSA | TrainingModel, *, seed: int = 0, n: int = 64, context: int | None = None,
             batch_size: int = 16, num_distractors: int = 0) -> dict[str, float]:
    """Metrics over ``n`` held-out samples per task (the "eval" split under ``seed``); see the module doc."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n = {n!r} must be a positive int (samples per task)")
    tm = model if isinstance(model, TrainingModel) else TrainingModel(model)
    cfg = tm.model.config
    context = tasks.default_context(cfg) if context is None else context
    if not 8 <= context <= cfg.max_seq_len:
        raise ValueError(f"context = {context} must be in [8, max_seq_len = {cfg.max_seq_len}]")
    out: dict[str, float] = {}
    with torch.no_grad():
        acc, recall, digits = _retrieval(tm, "indexer", seed, n, context, batch_size, num_distractors)
        out["retrieval_accuracy"] = acc
        out["retrieval_digit_accuracy"] = digits
        out["retrieval_accuracy_random_selection"] = _retrieval(tm, "random", seed, n, context, batch_size,
                                                                 num_distractors)[0]
        out.update({f"indexer_recall_layer{layer}": r for layer, r in sorted(recall.items())})
        out["multimodal_accuracy"] = _multimodal(tm, seed, n, batch_size, "indexer")
        # the same tasks with dense attention: what sparse attention costs, and (before the indexer has
        # been trained, in training's dense stage) what the model has learned
        out["retrieval_accuracy_dense"] = _retrieval(tm, "dense", seed, n, context, batch_size,
                                                     num_distractors)[0]
        out["multimodal_accuracy_dense"] = _multimodal(tm, seed, n, batch_size, "dense")
    out["context_length"] = context
    out["topk"] = cfg.indexer.topk
    return out


def format_metrics(metrics: dict[str, float]) -> str:
    """One ``name: value`` line per metric (accuracies and recalls with 4 decimals, counts as integers)."""
    return "\n".join(f"{k}: {v}" if isinstance(v, int) else f"{k}: {v:.4f}" for k, v in metrics.items())


def rows_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V], labels [B, T] (-100 = no target) -> bool [B]: every target is the argmax."""
    hit = (logits.argmax(-1) == labels) | (labels == -100)
    return hit.all(dim=1)


def digits_correct(logits: torch.Tensor, labels: torch.Tensor, eos_id: int) -> tuple[int, int]:
    """(pass-key digits that are the argmax of the teacher-forced logits, digits): the eos label left out."""
    digit = (labels != -100) & (labels != eos_id)
    return int(((logits.argmax(-1) == labels) & digit).sum()), int(digit.sum())


def _retrieval(tm: TrainingModel, selection: str, seed: int, n: int, context: int, batch_size: int,
               num_distractors: int) -> tuple[float, dict[int, float], float]:
    """(accuracy, {MLA layer index: recall}, digit accuracy) over n retrieval samples with the given selection."""
    gen = torch.Generator().manual_seed(seed)  # the random selections are part of the seeded evaluation
    correct, mass, count, digit_hits = 0, {}, {}, [0, 0]
    for start in range(0, n, batch_size):
        batch = tasks.encode(tasks.samples("retrieval", "eval", seed, start, min(batch_size, n - start), context,
                                         num_distractors), tm.model.config)
        ids, labels = batch.input_ids.to(tm.model.device), batch.labels.to(tm.model.device)
        logits, recorded = tm(ids, selection=selection, record=selection == "indexer", generator=gen)
        correct += int(rows_correct(logits, labels).sum())
        digit_hits = [a + b for a, b in zip(digit_hits, digits_correct(logits, labels, tm.model.tokenizer.eos_id))]
        for mla, x in recorded.items():
            m, c = captured_mass(mla, x)
            mass[mla.layer_idx] = mass.get(mla.layer_idx, 0.0) + m
            count[mla.layer_idx] = count.get(mla.layer_idx, 0) + c
    return correct / n, {layer: mass[layer] / max(count[layer], 1) for layer in mass}, digit_hits[0] / digit_hits[1]


def captured_mass(mla, x: torch.Tensor) -> tuple[float, int]:
    """Sum over queries with more causal keys than top-k of the dense attention mass (each head's softmax over
    every causal key, averaged over heads) on the keys the indexer selects, and the number of such queries."""
    B, T, _ = x.shape
    causal = causal_mask(T, x.device)
    dense = attention_target(mla, x, causal.expand(B, T, T))  # [B, T, S]: head-averaged dense probabilities
    keep = selection_mask(indexer_scores(mla, mla._project(x)), mla.indexer.topk, T, x.device, "indexer")
    per_query = (dense * keep.to(acc_dtype(dense))).sum(-1)  # [B, T]
    rows = torch.arange(T, device=x.device) >= mla.indexer.topk  # earlier queries keep every key: recall 1
    return float(per_query[:, rows].sum()), int(rows.sum()) * B


def _multimodal(tm: TrainingModel, seed: int, n: int, batch_size: int, selection: str) -> float:
    correct = 0
    for start in range(0, n, batch_size):
        batch = tasks.encode(tasks.samples("multimodal", "eval", seed, start, min(batch_size, n - start)),
                            tm.model.config)
        logits = multimodal_logits(tm, batch, selection)[0]
        correct += int(rows_correct(logits, batch.labels.to(tm.model.device)).sum())
    return correct / n


def multimodal_logits(tm: TrainingModel, batch: tasks.TokenBatch, selection: str = "indexer",
                      record: bool = False) -> tuple[torch.Tensor, dict]:
    """(logits [B, T, V], {GatedMLA: its input x} if ``record`` else {}) of a batch with images: vision tower +
    projector, embeddings filled, then the lean forward (``TrainingModel.forward``)."""
    ids = batch.input_ids.to(tm.model.device)
    embeds = tm.model.embed(ids, tm.model.encode_images(batch.images))
    return tm(inputs_embeds=embeds, selection=selection, record=record)
