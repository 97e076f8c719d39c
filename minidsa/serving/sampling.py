"""Choosing the next token from the model's logits: greedy, temperature, top-k, nucleus (top-p)."""

from __future__ import annotations

import torch


def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                      generator: torch.Generator | None = None, top_k: int = 0) -> int:
    """logits [vocab] (any float dtype, any device) -> one token id.

    temperature 0 takes the argmax (ties -> lowest id); otherwise sample from softmax(logits / temperature)
    restricted to the ``top_k`` most likely tokens (0 = all), then to the smallest set of most likely
    tokens whose mass reaches ``top_p`` (1 = no cut).
    ``generator`` (a CPU torch.Generator) makes the draw reproducible. Reading the chosen id back to
    the host is the one device sync of a decode step.
    """
    if logits.dim() != 1:
        raise ValueError(f"logits must be one row [vocab], got shape {tuple(logits.shape)}")
    logits = logits.detach().float().cpu()
    if temperature == 0:
        return int(torch.argmax(logits))
    if 0 < top_k < logits.numel():  # ties at the k-th value are kept: the cut must not depend on order
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of strictly more likely tokens
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
