"""The lean ops of the training path (forward.py): the same functions as the reference
layers compute, written for a forward + backward over fixed sequences, where every key is in memory.

* ``selection_mask``: the indexer's top-k as a boolean key mask [B, T, S] (no per-query gathers), so
  attention over the selected keys is one SDPA call with that mask.
* ``kda_chunk_train``: chunked KDA from a zero state with the intra-chunk decays factored through a
  reference point in the middle of the chunk, so the pairwise terms are two matmuls instead of a
  [.., C, C, K] tensor, and one batched triangular solve per layer.
* ``grouped_experts``: routed experts over float master weights, tokens sorted by expert so each
  expert runs one matmul chain over only its own tokens.
Each is held equal to its reference by tests/training/test_training.py (docs/design.md §2, §5, §6).
"""

from __future__ import annotations

import torch

from .. import ops
from ..model.ffn import situ_glu
from ..ops import acc_dtype

MAX_DECAY_EXPONENT = 80.0  # |G - G_mid| bound of kda_chunk_train: e^80 ~ 5.5e34 stays finite in fp32 (max e^88.7)


def causal_mask(T: int, device) -> torch.Tensor:
    """bool [T, T], True where key s <= query t."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def selection_mask(scores: torch.Tensor | None, topk: int, T: int, device, selection: str = "indexer",
                   generator: torch.Generator | None = None, batch: int = 1) -> torch.Tensor:
    """bool [B, T, T] key mask of each query.

    "indexer": the reference top-k of ``scores`` [B, T, T] (ops.topk_indices: ties to the lower
    position), so training attends to exactly the keys the no-cache forward selects; "dense": every
    causal key; "random": ``topk`` causal keys drawn uniformly with ``generator`` (the baseline of
    the evaluation), all of them when a query has fewer candidates.
    """
    causal = causal_mask(T, device)
    if selection == "dense":
        return causal.expand(batch, T, T)
    if selection == "random":
        scores = torch.rand(batch, T, T, generator=generator, device="cpu").to(device)
    elif selection != "indexer":
        raise ValueError(f"selection = {selection!r}; use 'indexer', 'dense' or 'random'")
    B = scores.shape[0]
    idx = ops.topk_indices(scores, topk, torch.arange(T, device=device).expand(B, T))
    return ops.indices_to_mask(idx, T) & causal


def train_chunk_size(lower_bound: float, chunk_size: int) -> int:
    """The largest power of two <= chunk_size whose half-chunk decay |lb| * C / 2 stays <= MAX_DECAY_EXPONENT."""
    c = 1
    while 2 * c <= chunk_size and abs(lower_bound) * c <= MAX_DECAY_EXPONENT:
        c *= 2
    return c


def kda_chunk_train(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    chunk_size: int) -> torch.Tensor:
    """KDA from a zero state: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] -> o [B, T, H, V] (fp32/fp64).

    Equals ``ops.kda_chunk_ref`` (scale K^-0.5 on q; final state not returned). Within a chunk, with G the
    inclusive cumulative log-decay and G_m its value at the middle step,
        exp(G_i - G_j) = exp(G_i - G_m) * exp(G_m - G_j),
    so A_kk and A_qk are plain matmuls of decayed q/k. Every factor is at most e^(|lb| C / 2), which
    ``train_chunk_size`` keeps finite; pairs j > i can overflow but are masked before use.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = acc_dtype(q, k, v, g, beta)
    C = max(1, min(chunk_size, T))
    pad = (-T) % C  # padded steps: g = beta = k = v = 0 leave the state unchanged
    q, k, v, g = (torch.nn.functional.pad(x.to(acc), (0, 0, 0, 0, 0, pad)) for x in (q * K ** -0.5, k, v, g))
    beta = torch.nn.functional.pad(beta.to(acc), (0, 0, 0, pad))
    n = (T + pad) // C
    q, k, v, g = (x.view(B, n, C, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))  # [B, H, n, C, *]
    beta = beta.view(B, n, C, H).permute(0, 3, 1, 2).unsqueeze(-1)  # [B, H, n, C, 1]
    G = g.cumsum(dim=3)
    G_mid = G[:, :, :, C // 2: C // 2 + 1]
    k_down = k * torch.exp(G_mid - G)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    A_kk = ((k * torch.exp(G - G_mid)) @ k_down.mT).masked_fill(~strict, 0.0) * beta
    A_qk = ((q * torch.exp(G - G_mid)) @ k_down.mT).masked_fill(~causal_mask(C, q.device), 0.0)
    eye = torch.eye(C, dtype=acc, device=q.device)
    rhs = torch.cat([beta * G.exp() * k, beta * v], dim=-1)  # W and U of the WY form in one solve
    W, U = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True).split([K, V], dim=-1)
    q_decayed, G_last = G.exp() * q, G[:, :, :, -1]  # [B, H, n, C, K], [B, H, n, K]
    k_to_end_T = (torch.exp(G_last.unsqueeze(3) - G) * k).mT.unbind(2)  # n x [B, H, K, C]
    decay = G_last.exp().unsqueeze(-1).unbind(2)  # n x [B, H, K, 1]
    W, U = W.unbind(2), U.unbind(2)
    S = q.new_zeros(B, H, K, V)
    starts, v_news = [], []  # the state entering each chunk, and the chunk's corrected values
    for c in range(n):  # the only sequential part, kept to its two small matmuls (a GPU step counts launches)
        v_new = U[c] - W[c] @ S
        starts.append(S)
        v_news.append(v_new)
        S = decay[c] * S + k_to_end_T[c] @ v_new
    out = q_decayed @ torch.stack(starts, dim=2) + A_qk @ torch.stack(v_news, dim=2)  # [B, H, n, C, V]
    return out.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]


def grouped_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                    w2: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    """Routed experts over float weights: z [N, L], ids int [N, top_k], weights [N, top_k], w1/w3 [E, I, L],
    w2 [E, L, I] -> sum_i weights_i * E_{ids_i}(z) [N, L].

    The N * top_k (token, expert) pairs are sorted by expert and placed in a zero-padded [E, cap, L] block
    (cap = the busiest expert's pair count), so all experts run as three batched matmuls: a few launches
    per layer instead of a few per expert (a GPU step is otherwise bound by launches). Padded rows are
    zeros, which SiTU-GLU maps to zeros, and are never read back. cap is read on the host (one sync per
    layer), which training can afford.
    """
    N, top_k = ids.shape
    E = w1.shape[0]
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    expert, token = flat[order], order // top_k  # expert and token of each sorted pair
    counts = torch.bincount(flat, minlength=E)
    rank = torch.arange(flat.numel(), device=z.device) - (torch.cumsum(counts, 0) - counts)[expert]
    x = z.new_zeros(E, int(counts.max()), z.shape[1]).index_put((expert, rank), z.index_select(0, token))
    h = situ_glu(x @ w1.mT, x @ w3.mT, beta_gate, beta_up) @ w2.mT  # [E, cap, L]
    y = h[expert, rank] * weights.reshape(-1)[order].unsqueeze(-1).to(z.dtype)
    return torch.zeros_like(z).index_add_(0, token, y)

