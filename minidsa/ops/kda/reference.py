"""Reference Kimi Delta Attention: the recurrence and its chunked (WY/UT) form (docs/design.md §5).

Layouts follow flash-linear-attention: q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H);
g [B, T, HV, K] log-decay per channel; beta [B, T, HV]; state [B, HV, K, V]. Math in fp32
(fp64 when any input is fp64); the state is returned in that precision, the output in v's dtype.

Per head and step t (alpha_t = exp(g_t) per key channel, q already scaled):
    S <- Diag(alpha_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T        (delta rule: write the prediction error)
    o_t = S^T q_t
"""

from __future__ import annotations

import torch

from .._checks import acc_dtype, cast
from .._denormals import EXP_FLOOR, floored_exp, flush_denormals
from .._dispatch import op
from .._library import result_like
from .checks import check_chunk_size, check_lengths, check_recurrence, check_state_at


def state_results(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrences' results as a kernel's fake makes them: o [B, T, HV, V] in v's dtype, the state
    [B, HV, K, V] in the accumulation dtype."""
    B, T, HV, V = v.shape
    return result_like(v, (B, T, HV, V), v.dtype), result_like(v, (B, HV, q.shape[-1], V))


def on_flushed(impl, q, *args, **kwargs):
    """``impl(q, ...)`` with subnormal floats flushed to zero on a CPU: the exp of long decays makes them, and
    a CPU is slow on them."""
    with flush_denormals(q):
        return impl(q, *args, **kwargs)


def chunk_call(impl, q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64, state_at=None, lengths=None):
    """How ``kda_chunk`` calls its implementation: always with the kept states among the results (one result
    type, as a custom op's schema needs), returned only when ``state_at`` asked for them."""
    with flush_denormals(q):
        o, state, kept = impl(q, k, v, g, beta, scale, initial_state, chunk_size, state_at, lengths)
    return (o, state) if state_at is None else (o, state, kept)


def kept_states(states: list[torch.Tensor], state_at: torch.Tensor | None, T: int, C: int) -> torch.Tensor:
    """The states asked for by ``state_at`` [M, 2] from ``states``, the state at the start of each chunk of C
    tokens and, last, the final one ([B, HV, K, V] each) -> [M, HV, K, V], zeros for padding pairs."""
    if state_at is None:
        return states[0].new_zeros((0, *states[0].shape[1:]))
    row, t = state_at.long().unbind(1)
    n = len(states) - 1
    chunk = torch.where(t >= T, n, t.clamp_min(0) // C)
    real = row >= 0
    out = torch.stack(states, 1)[row.clamp_min(0), chunk]  # [M, HV, K, V]
    return out * real.view(-1, 1, 1, 1).to(out.dtype)


def prepare(q, k, v, g, beta, scale, initial_state):
    """The recurrences' inputs checked, q scaled, all in the accumulation dtype, GQA heads repeated, and the
    starting state (zeros without one)."""
    B, T, H, K, HV, V = check_recurrence(q, k, v, g, beta, initial_state)
    acc = acc_dtype(q, k, v, g, beta, *([initial_state] if initial_state is not None else []))
    rep = HV // H
    scale = K ** -0.5 if scale is None else float(scale)
    if rep > 1:  # grouped value heads: each q/k head serves HV/H value heads
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q = cast(q, acc) * scale
    k = cast(k, acc)
    # Never updated in place below, so the caller's state is not modified even without a copy; with
    # T = 0 it would come back as the caller's own tensor, so that case gets one.
    state = torch.zeros(B, HV, K, V, dtype=acc, device=q.device) if initial_state is None else \
        initial_state.to(acc, copy=T == 0)
    return q, k, cast(v, acc), cast(g, acc), cast(beta, acc), state


@op(kernel="recurrent_triton", fake=lambda q, k, v, g, beta, scale, initial_state: state_results(q, v), call=on_flushed)
def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float | None = None,
                  initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step KDA. Returns (o [B, T, HV, V] in v.dtype, final_state [B, HV, K, V] fp32/fp64).

    ``scale`` defaults to K^-0.5 and multiplies q.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, S = prepare(q, k, v, g, beta, scale, initial_state)
    T = q.shape[1]
    o = torch.empty_like(v)
    # Row vectors [B, HV, 1, K] times the state [B, HV, K, V]: plain batched matmuls.
    q, k, v = q.unsqueeze(-2), k.unsqueeze(-2), v.unsqueeze(-2)
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)  # decay each key channel
        pred = k[:, t] @ S  # [B, HV, 1, V]: what the state already returns for k_t
        S = S + (beta[:, t, :, None, None] * k[:, t]).transpose(-1, -2) @ (v[:, t] - pred)  # rank-1 write
        o[:, t] = (q[:, t] @ S).squeeze(-2)
    return cast(o, out_dtype), S


def intra_chunk_products(q, k, G) -> tuple[torch.Tensor, torch.Tensor]:
    """A_qk[i, j] = sum_d q_id k_jd exp(G_id - G_jd) for j <= i, and A_kk the same with k_i for j < i (zero
    elsewhere), for chunks q, k, G [..., C, K] -> [..., C, C] each. Every exponent kept is <= 0; the pairs
    j > i, whose exponents are positive, are held at 0 and then masked away."""
    C = q.shape[-2]
    decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).clamp(EXP_FLOOR, 0.0).exp()  # [..., C(i), C(j), K]
    kd = decay * k.unsqueeze(-3)
    A_qk = (kd * q.unsqueeze(-2)).sum(-1)
    A_kk = (kd * k.unsqueeze(-2)).sum(-1)
    tri = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    return A_qk * tri, A_kk * tri.tril(-1)


def chunk_step(q, k, v, g, beta, S, products=intra_chunk_products):
    """One chunk of every row given (q, k, g [R, H, C, K], v [R, H, C, V], beta [R, H, C], S [R, H, K, V], see
    ``kda_chunk_ref``) -> (o [R, H, C, V], the state after it). ``products`` computes A_qk and A_kk (the CPU
    form passes a faster factoring of the same sums)."""
    C = q.shape[-2]
    G = g.cumsum(dim=-2)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    A_qk, A_kk = products(q, k, G)
    A_kk = beta.unsqueeze(-1) * A_kk
    M = torch.linalg.solve_triangular(eye + A_kk, eye.expand_as(A_kk), upper=False, unitriangular=True)
    W = M @ (beta.unsqueeze(-1) * floored_exp(G) * k)
    v_new = M @ (beta.unsqueeze(-1) * v) - W @ S  # U - W S0
    o = (floored_exp(G) * q) @ S + A_qk @ v_new
    G_last = G[..., -1, :]  # [R, H, K]
    return o, floored_exp(G_last).unsqueeze(-1) * S + (floored_exp(G_last.unsqueeze(-2) - G) * k).mT @ v_new


@op(kernel="chunk_triton", cpu="chunk_cpu", call=chunk_call,
    fake=lambda q, k, v, g, beta, scale, initial_state, chunk_size, state_at=None, lengths=None: (*state_results(q, v),
        result_like(v, (0 if state_at is None else state_at.shape[0], v.shape[2], q.shape[-1], v.shape[3]))))
def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, chunk_size: int = 64,
              state_at: torch.Tensor | None = None,
              lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked KDA, equal to ``kda_recurrent_ref`` (same inputs plus ``chunk_size``) -> (o, final state, kept):
    ``kept`` [M, HV, K, V] holds, for each (row, position t) pair of ``state_at`` int [M, 2], the row's state
    after its first t tokens (what a prefix cache keeps; t a multiple of ``chunk_size`` or T, see
    ``check_state_at``); without ``state_at`` it is empty (M = 0). ``lengths`` int [B]: row b's real tokens;
    the rest of the row is padding, which leaves the state as it is and gets o = 0.

    Within a chunk of C steps, with G = inclusive cumulative log-decay [C, K] and S0 the state at its start:
      A_kk[i,j] = beta_i sum_d k_id k_jd exp(G_id - G_jd), j < i
      M = (I + A_kk)^-1 (unit lower triangular: forward substitution)
      W = M Diag(beta) (exp(G) * K),   U = M Diag(beta) V,   V_new = U - W S0
      O = (exp(G) * Q) S0 + A_qk V_new,  A_qk[i,j] = sum_d q_id k_jd exp(G_id - G_jd), j <= i
      S = Diag(exp(G_C)) S0 + (exp(G_C - G) * K)^T V_new
    Every exponent is a difference G_i - G_j with j <= i, or G itself, so it is <= 0: no overflow.
    Any T: the tail is padded with g = beta = k = v = 0 (steps that leave the state unchanged); T < chunk_size is one chunk.
    """
    check_chunk_size(chunk_size)
    out_dtype = v.dtype
    q, k, v, g, beta, S = prepare(q, k, v, g, beta, scale, initial_state)
    B, T, H, K = q.shape
    check_state_at(state_at, B, T, chunk_size)
    if lengths is not None:  # padding made inert: zero decay, key, value and beta leave the state as it is
        real = (torch.arange(T, device=q.device) < check_lengths(lengths, B, T).view(B, 1).to(q.device)).to(q.dtype)
        q, k, v, g, beta = (x * real.view(B, T, *[1] * (x.dim() - 2)) for x in (q, k, v, g, beta))
    if T == 0:  # no step: the state passes through (a copy, see prepare)
        return v.to(out_dtype), S, kept_states([S], state_at, T, 1)
    q, k, v, g, beta, n, C = to_chunks(q, k, v, g, beta, chunk_size)
    o = torch.zeros_like(v)
    starts = []  # the state at the start of each chunk
    for c in range(n):
        starts.append(S)
        o[:, :, c], S = chunk_step(q[:, :, c], k[:, :, c], v[:, :, c], g[:, :, c], beta[:, :, c], S)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, -1)[:, :T].to(out_dtype)
    return o, S, kept_states(starts + [S], state_at, T, C)


def to_chunks(q, k, v, g, beta, chunk_size: int):
    """[B, T, H, ...] inputs -> chunks [B, H, n, C, ...] (beta [B, H, n, C]), the tail padded with zeros, and
    (n, C). Heads first, so each chunk is a batch of small matrices; contiguous, so the pair tensors built from
    them inherit plain strides."""
    B, T, H = q.shape[:3]
    C = min(chunk_size, T)
    pad = (-T) % C
    if pad:
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // C
    q, k, v, g = (x.view(B, n, C, H, -1).permute(0, 3, 1, 2, 4).contiguous() for x in (q, k, v, g))
    return q, k, v, g, beta.view(B, n, C, H).permute(0, 3, 1, 2), n, C


# The plain references by the names the kernels' fallbacks and the tests call them.
kda_recurrent_ref = kda_recurrent.reference
kda_chunk_ref = kda_chunk.reference
