"""KDA's chunk form in a fast CPU form: ``kda_chunk_ref``'s signature and results (the parity tests hold them
equal), chosen by the "auto" backend for CPU tensors (ops/_dispatch.py, CPU_FORMS).

Two things make the difference on a CPU:
- the intra-chunk pair sums A_qk, A_kk as matrix products of 16-step sub-chunks (``factored_products``)
  instead of the reference's [C, C, K] decay tensor: exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), r the
  first step of i's sub-chunk. Within a sub-chunk the second factor is >= 1, so the host checks the
  sub-chunks' decay span first (a read of CPU data, no device sync);
- rows of a padded rectangle skip the chunks past their length (``active_rows``).
"""

from __future__ import annotations

import functools

import torch

from .._checks import on_host
from .._denormals import EXP_FLOOR
from .checks import check_chunk_size, check_lengths, check_state_at
from .reference import chunk_step, kda_chunk_ref, kept_states, prepare, to_chunks

SUB_CHUNK = 16  # pairs within a sub-chunk: one small matmul (or the pairwise decay tensor); across: a matmul
# Largest decay span G_r - G_j (r the first step of a sub-chunk, j in it) for which the factor exp(G_r - G_j)
# and its partner exp(G_i - G_r) stay inside the normal range (fp32: e^+-87). With the model's decay floor
# of -5, a 16-step sub-chunk spans at most 75.
FACTOR_SPAN = {torch.float32: 80.0, torch.float64: 700.0}


def factored_products(q, k, G, c: int = SUB_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """A_qk[i, j] = sum_d q_id k_jd exp(G_id - G_jd) for j <= i and A_kk the same with k_i for j < i (zero
    elsewhere), over chunks [..., C, K] cut into sub-chunks of c.

    With r the first step of i's sub-chunk, exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j). Across
    sub-chunks (j < r <= i) both exponents are <= 0 (G only falls), so nothing overflows and the pair is
    a plain matrix product. Within a sub-chunk (r <= j <= i) the second exponent is >= 0 but at most the
    sub-chunk's span: where the span stays below FACTOR_SPAN (always, for the model's decay floor) the pairs
    are one c x c matrix product too; otherwise they use the pairwise decay tensor exp(G_i - G_j) [c, c, K]."""
    *pre, C, K = q.shape
    S = C // c
    Gs, qs, ks = (x.view(*pre, S, c, K) for x in (G, q, k))
    Gr = Gs[..., :1, :]  # [..., S, 1, K]: G at the first step of each sub-chunk
    left = (Gs - Gr).exp()  # [..., S, c, K], each <= 1 (not floored: it meets k_up's large factors below)
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    span = FACTOR_SPAN.get(q.dtype, 0.0)
    if G.numel() and float((Gr - Gs[..., -1:, :]).detach().amax()) <= span:
        k_up = (Gr - Gs).exp() * ks  # each factor in [1, e^span]
        # Entries above the diagonal (j > i) may be huge or inf: selected away, never multiplied by zero.
        diag_qk, diag_kk = (((left * x) @ k_up.mT).masked_fill_(~tri, 0.0) for x in (qs, ks))  # [..., S, c, c]
    else:
        # Pairs j > i have exponents >= 0: held at 0 (no overflow) and zeroed by the mask.
        decay = (Gs.unsqueeze(-2) - Gs.unsqueeze(-3)).clamp(EXP_FLOOR, 0.0).exp_()
        kd = decay * (tri.unsqueeze(-1).to(ks.dtype) * ks.unsqueeze(-3))  # [..., S, c(i), c(j), K]
        diag_qk, diag_kk = ((kd @ x.unsqueeze(-1)).squeeze(-1) for x in (qs, ks))  # [..., S, c, c]
    before = torch.arange(C, device=q.device).view(1, C) < torch.arange(0, C, c, device=q.device).view(S, 1)
    # As above: the pairs j >= r (exponents >= 0) held at 0 and zeroed by the mask.
    right = (Gr - G.unsqueeze(-3)).clamp(EXP_FLOOR, 0.0).exp_() * (before.unsqueeze(-1).to(k.dtype) * k.unsqueeze(-3))
    A_qk, A_kk = (((left * x) @ right.mT).reshape(*pre, C, C) for x in (qs, ks))  # across sub-chunks
    for A, diag in ((A_qk, diag_qk), (A_kk, diag_kk)):
        A.view(*pre, S, c, S, c).diagonal(dim1=-4, dim2=-2).add_(diag.movedim(-3, -1))
    A_kk.diagonal(dim1=-2, dim2=-1).zero_()  # j < i only
    return A_qk, A_kk


def active_rows(lengths, B: int, n: int, C: int) -> list:
    """Per chunk c: the rows with a real token in it (int64 indices), or None for all rows (lengths on the
    host; elsewhere every row, as the reference: a padded chunk costs work, not a wrong answer)."""
    if lengths is None or not on_host(lengths):
        return [None] * n
    chunks = (lengths.long() + C - 1) // C
    return [None if bool((chunks > c).all()) else (chunks > c).nonzero().view(-1) for c in range(n)]


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, chunk_size: int = 64,
              state_at: torch.Tensor | None = None,
              lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kda_chunk_ref`` with the factored pair sums and the padded chunks of short rows skipped. Inputs
    off the host go to the reference (this form reads values on the host)."""
    if not on_host(q, k, g):
        return kda_chunk_ref(q, k, v, g, beta, scale, initial_state, chunk_size, state_at, lengths)
    check_chunk_size(chunk_size)
    out_dtype = v.dtype
    q, k, v, g, beta, S = prepare(q, k, v, g, beta, scale, initial_state)
    B, T, H, K = q.shape
    check_state_at(state_at, B, T, chunk_size)
    if lengths is not None:  # padding made inert here, so that skipping it changes nothing
        real = (torch.arange(T, device=q.device) < check_lengths(lengths, B, T).view(B, 1).to(q.device)).to(q.dtype)
        q, k, v, g, beta = (x * real.view(B, T, *[1] * (x.dim() - 2)) for x in (q, k, v, g, beta))
    if T == 0:
        return v.to(out_dtype), S, kept_states([S], state_at, T, 1)
    q, k, v, g, beta, n, C = to_chunks(q, k, v, g, beta, chunk_size)
    products = functools.partial(factored_products, c=SUB_CHUNK if C % SUB_CHUNK == 0 else C)
    o = q.new_zeros(B, H, n, C, v.shape[-1])
    starts = []
    for c, rows in enumerate(active_rows(lengths, B, n, C)):
        starts.append(S)
        pick = (lambda x: x[:, :, c]) if rows is None else (lambda x: x[rows, :, c])
        o_c, S_c = chunk_step(*(pick(x) for x in (q, k, v, g, beta)), S if rows is None else S[rows], products)
        if rows is None:
            o[:, :, c], S = o_c, S_c
        else:
            o[rows, :, c], S = o_c, S.index_copy(0, rows, S_c)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, -1)[:, :T].to(out_dtype)
    return o, S, kept_states(starts + [S], state_at, T, C)
