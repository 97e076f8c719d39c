"""A KDA layer's step around the recurrence: the short convs, the per-token inputs, and the fused decode step
(docs/design.md §5).

Between the layer's input products and the gated delta rule (``ops/kda``) sit small per-channel operations:
the depthwise causal convs over q, k and v (continuing from a conv state), SiLU, the L2 norms of q and k, the
log-decay g and the write strength beta. The prefill path runs them as ``short_conv`` and ``kda_inputs``;
the decode path as one op, ``kda_decode``, which also reads the sequences' states from the cache's pools and
runs the recurrence's single step, because a compiled step would otherwise launch them as several kernels
(the conv-state gather, the short convs, SiLU, the decay's up projection, the norms and gates, the
recurrent-state gather). Per token (``kda_decode``'s form; the prefill shares every line but the last):

    y, C' = causal_conv(projected, conv_weight, conv_pool[slots])     short convs continuing from the state
    qkv  = SiLU(y)                                                    [B, 3, H, K]
    z    = W_fb f_a, rounded to W_fb's dtype (what the layer's product returns)
    q, k = L2-normalised rows of qkv[:, 0], qkv[:, 1] (per head)      v = qkv[:, 2]
    g    = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))       log-decay per key channel
    beta = sigmoid(b)                                                 one per head
    (o, S') = kda_recurrent(q, k, v, g, beta, scale, state_pool[slots])   T = 1
"""

from __future__ import annotations

import torch

from .._checks import acc_dtype, cast
from .._dispatch import op
from .._library import result_like
from ..kda.reference import kda_recurrent_ref
from .checks import check_decode, check_inputs, check_short_conv

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


@op(kernel="inputs_triton", fake=lambda qkv, z, b, A_log, dt_bias, lower_bound: (
    *(result_like(qkv, qkv.shape[:-3] + qkv.shape[-2:]) for _ in range(3)), result_like(qkv, b.shape)))
def kda_inputs(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   lower_bound: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kda_step_inputs`` as one op: (q, k, g [..., H, K], beta [..., H]), the same values; v, a view of qkv,
    is not among its results (an op's results own their memory)."""
    check_inputs(qkv, z, b)
    q, k, _, g, beta = kda_step_inputs(qkv, z, b, A_log, dt_bias, lower_bound)
    return q, k, g, beta


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
kda_decode_ref = kda_decode.reference
short_conv_ref = short_conv.reference
kda_inputs_ref = kda_inputs.reference
