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

from .._checks import acc_dtype, cast, check_tensor
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


# ---------------------------------------------------------------- one decode step from the projections
# The layer's decode reads its inputs from two products of the layer input (the fused input projection and
# the decay's rank-R down projection f_a) and the cache; everything between them and the recurrence is small
# per-channel arithmetic that a compiled step would otherwise launch as several kernels (the conv-state
# gather, the short convs, SiLU, the decay's up projection, the norms and gates, the recurrent-state gather).
# ``kda_decode_ref`` is that whole step; ``causal_conv`` and ``kda_step_inputs`` the pieces it shares with the
# prefill path (model/kda.py):
#     y, C' = causal_conv(projected, conv_weight, conv_pool[slots])     short convs continuing from the state
#     qkv  = SiLU(y)                                                    [B, 3, H, K]
#     z    = W_fb f_a, rounded to W_fb's dtype (what the layer's product returns)
#     q, k = L2-normalised rows of qkv[:, 0], qkv[:, 1] (per head)      v = qkv[:, 2]
#     g    = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))       log-decay per key channel
#     beta = sigmoid(b)                                                 one per head
#     (o, S') = kda_recurrent(q, k, v, g, beta, scale, state_pool[slots])   T = 1

L2_EPS = 1e-6  # q, k <- x / sqrt(sum x^2 + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv continuing from ``state``.

    x [B, T, C], weight [C, 1, W], state [B, W-1, C] (the previous W-1 inputs, zeros at the start), lengths
    int [B] or None -> (y [B, T, C], new_state [B, W-1, C]); y[t] = sum_i weight[:, 0, i] * [state; x][t + i].
    new_state holds the W-1 inputs before each row's end: lengths[b] (rows of a padded rectangle of pieces
    end before T) or T.
    """
    B, T, W = x.shape[0], x.shape[1], weight.shape[-1]
    full = torch.cat([cast(state, x.dtype), x], dim=1)  # [B, W-1+T, C]
    w = cast(weight[:, 0, :], x.dtype)  # [C, W]
    y = full[:, :T] * w[:, 0]
    for i in range(1, W):  # W shifted rows, each read contiguously (an unfolded window's are strided)
        y.addcmul_(full[:, i:i + T], w[:, i])
    if lengths is None:
        return y, full[:, full.shape[1] - (W - 1):]
    return y, conv_states_at(full, W - 1, torch.arange(B, device=x.device), lengths.to(x.device))


def conv_states_at(full: torch.Tensor, state_len: int, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The conv states after the first ends[m] inputs of row rows[m]: full [B, S+T, C] (each row's state of
    S = state_len = W-1 entries, then its inputs), rows and ends int [M] on full's device -> [M, S, C], the S
    entries before position S+ends[m] (``causal_conv``'s state for those inputs alone). A row of -1 (a padding
    pair of a captured step) reads row 0: its state is never used."""
    at = ends.long().view(-1, 1) + torch.arange(state_len, device=full.device)
    return full[rows.long().clamp_min(0).view(-1, 1), at]


def check_short_conv(x, weight, state, lengths) -> tuple[int, int, int, int]:
    """``short_conv``'s argument checks (reference and kernel alike) -> (B, T, C, W)."""
    B, T, C = check_tensor("x", x, ndim=3, floating=True)
    W = check_tensor("weight", weight, shape=(C, 1, None), floating=True)[2]
    if W < 1:
        raise ValueError(f"weight has width {W}; a conv needs width >= 1")
    check_tensor("state", state, shape=(B, W - 1, C), floating=True)
    if lengths is not None:
        check_tensor("lengths", lengths, shape=(B,), integer=True)
    return B, T, C, W


@op(kernel="conv_triton",
    fake=lambda x, weight, state, lengths=None: (result_like(x, x.shape), result_like(x, state.shape)))
def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                   lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's short conv and its SiLU: x [B, T, C] (q, k, v before the convs), weight [C, 1, W], state
    [B, W-1, C], lengths int [B] or None -> (SiLU(causal_conv(x)) [B, T, C], the state at each row's end
    [B, W-1, C]), in the accumulation dtype (fp32, fp64 kept). Padding rows past a length are computed like
    any other; their outputs are the caller's to drop."""
    check_short_conv(x, weight, state, lengths)
    y, new_state = causal_conv(cast(x, acc_dtype(x, weight, state)), weight, state, lengths)
    return torch.nn.functional.silu(y), new_state


def kda_step_inputs(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                    dt_bias: torch.Tensor, lower_bound: float):
    """qkv [..., 3, H, K] (SiLU of the short convs), z [..., H*K] (W_fb W_fa x), b [..., H] (W_b x) ->
    (q, k, v [..., H, K], g [..., H, K], beta [..., H]) in the accumulation dtype."""
    H, K = qkv.shape[-2:]
    acc = acc_dtype(qkv)
    qk = qkv[..., :2, :, :]  # q and k are L2-normalised per head, in one pass
    q, k = (qk * torch.rsqrt(qk.pow(2).sum(-1, keepdim=True) + L2_EPS)).unbind(-3)
    z = cast(z, acc) + cast(dt_bias, acc)
    a = cast(A_log[:H], acc).exp().unsqueeze(-1)  # [H, 1]: one rate per head, over its K channels
    g = lower_bound * torch.sigmoid(a * z.unflatten(-1, (H, K)))
    return q, k, qkv[..., 2, :, :], g, torch.sigmoid(cast(b, acc))


def check_inputs(qkv, z, b) -> tuple[int, int]:
    """(H, K) after checking ``kda_inputs``'s arguments."""
    shape = check_tensor("qkv", qkv, floating=True)
    if len(shape) < 3 or shape[-3] != 3:
        raise ValueError(f"qkv must be [..., 3, H, K] (q, k, v), got shape {tuple(shape)}")
    H, K = shape[-2:]
    check_tensor("z", z, shape=(*shape[:-3], H * K), floating=True)
    check_tensor("b", b, shape=(*shape[:-3], H), floating=True)
    return H, K


@op(kernel="inputs_triton", fake=lambda qkv, z, b, A_log, dt_bias, lower_bound: (
    *(result_like(qkv, qkv.shape[:-3] + qkv.shape[-2:]) for _ in range(3)), result_like(qkv, b.shape)))
def kda_inputs(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   lower_bound: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kda_step_inputs`` as one op: (q, k, g [..., H, K], beta [..., H]), the same values; v, a view of qkv,
    is not among its results (an op's results own their memory)."""
    check_inputs(qkv, z, b)
    q, k, _, g, beta = kda_step_inputs(qkv, z, b, A_log, dt_bias, lower_bound)
    return q, k, g, beta


def check_decode(projected, f_a, b, conv_weight, w_fb, A_log, dt_bias, conv_pool, state_pool,
                 state_slots) -> tuple[int, int, int, int]:
    """(B, H, K, W) after checking the shapes (T = 1; value heads = key heads, K = V, as in the model)."""
    _, H, K, V = check_tensor("state_pool", state_pool, shape=(None, None, None, None), floating=True)
    if V != K:
        raise ValueError(f"state_pool has shape {tuple(state_pool.shape)}; its value width must equal the key "
                         f"width {K}")
    B, C = check_tensor("projected", projected, ndim=2, floating=True)
    if C != 3 * H * K:
        raise ValueError(f"projected has shape {tuple(projected.shape)}; dim 1 must be 3*H*K = {3 * H * K} "
                         f"(q, k, v of the state pool's {H} heads of width {K})")
    _, R = check_tensor("f_a", f_a, shape=(B, None), floating=True)
    check_tensor("b", b, shape=(B, H), floating=True)
    _, _, W = check_tensor("conv_weight", conv_weight, shape=(C, 1, None), floating=True)
    check_tensor("w_fb", w_fb, shape=(H * K, R), floating=True)
    if A_log.dim() != 1 or A_log.shape[0] < H:
        raise ValueError(f"A_log has shape {tuple(A_log.shape)}; it needs at least {H} entries (one per head)")
    check_tensor("dt_bias", dt_bias, shape=(H * K,), floating=True)
    check_tensor("conv_pool", conv_pool, shape=(state_pool.shape[0], W - 1, C), floating=True)
    check_tensor("state_slots", state_slots, shape=(B,), integer=True)
    return B, H, K, W


@op(kernel="decode_triton",
    fake=lambda projected, f_a, b, conv_weight, w_fb, A_log, dt_bias, lower_bound, conv_pool, state_pool, state_slots,
    scale=None: (
        result_like(projected, (projected.shape[0], *state_pool.shape[1:3])),
        result_like(projected, (projected.shape[0], *state_pool.shape[1:])),
        result_like(projected, (projected.shape[0], *conv_pool.shape[1:]))))
def kda_decode(projected: torch.Tensor, f_a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                   w_fb: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
                   conv_pool: torch.Tensor, state_pool: torch.Tensor, state_slots: torch.Tensor,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of a KDA layer from its projections: projected [B, 3*H*K] (W_q x, W_k x, W_v x side by
    side), f_a [B, R] (W_fa x), b [B, H] (W_b x), conv_weight [3*H*K, 1, W], w_fb [H*K, R], A_log [>= H],
    dt_bias [H*K], conv_pool [S, W-1, 3*H*K] and state_pool [S, H, K, K] (both read only, at state_slots int [B])
    -> (o [B, H, K], the new recurrent states [B, H, K, K], the new conv states [B, W-1, 3*H*K]), all in the
    accumulation dtype (fp32; fp64 for fp64 inputs)."""
    B, H, K, _ = check_decode(projected, f_a, b, conv_weight, w_fb, A_log, dt_bias, conv_pool, state_pool, state_slots)
    acc = acc_dtype(projected)
    rows = state_slots.long()
    y, conv = causal_conv(cast(projected, acc).unsqueeze(1), conv_weight, conv_pool[rows])
    qkv = torch.nn.functional.silu(y).view(B, 3, H, K)
    z = cast(torch.nn.functional.linear(cast(f_a, w_fb.dtype), w_fb), acc)
    q, k, v, g, beta = kda_step_inputs(qkv, z, b, A_log, dt_bias, lower_bound)
    o, state = kda_recurrent_ref(*(x.unsqueeze(1) for x in (q, k, v, g, beta)), scale, state_pool[rows])
    return o.squeeze(1), state, conv


# The plain references by the names the kernels' fallbacks and the tests call them.
kda_recurrent_ref = kda_recurrent.reference
kda_chunk_ref = kda_chunk.reference
kda_decode_ref = kda_decode.reference
short_conv_ref = short_conv.reference
kda_inputs_ref = kda_inputs.reference
