"""One KDA decode step from the layer's projections (docs/design.md §5): the reference of ``kda_decode``.

The layer's decode reads its inputs from a few projections and the cache; everything between them and
the recurrence is small per-head arithmetic that a compiled step would otherwise launch as several kernels
(one per tensor the recurrence reads):

    q, k = L2-normalised rows of qkv[:, 0], qkv[:, 1] (per head)      v = qkv[:, 2]
    g    = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))       log-decay per key channel
    beta = sigmoid(b)                                                 one per head
    S    = state_pool[slots]                                          this step's sequences' states
    (o, S') = kda_recurrent(q, k, v, g, beta, scale, S)               T = 1

``kda_step_inputs`` is the arithmetic shared with the prefill path (model/kda.py), so both compute the same
q, k, g and beta.
"""

from __future__ import annotations

import torch

from .._checks import acc_dtype, cast, check_tensor
from .reference import kda_recurrent_ref

L2_EPS = 1e-6  # q, k <- x / sqrt(sum x^2 + eps)


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


def check_decode(qkv, z, b, A_log, dt_bias, state_pool, slots) -> tuple[int, int, int, int]:
    """(B, H, K, V) after checking the shapes (T = 1; value heads = key heads, as in the model)."""
    B, three, H, K = check_tensor("qkv", qkv, ndim=4, floating=True)
    if three != 3:
        raise ValueError(f"qkv has shape {tuple(qkv.shape)}; dim 1 must be 3 (q, k, v)")
    check_tensor("z", z, shape=(B, H * K), floating=True)
    check_tensor("b", b, shape=(B, H), floating=True)
    if A_log.dim() != 1 or A_log.shape[0] < H:
        raise ValueError(f"A_log has shape {tuple(A_log.shape)}; it needs at least {H} entries (one per head)")
    check_tensor("dt_bias", dt_bias, shape=(H * K,), floating=True)
    _, _, _, V = check_tensor("state_pool", state_pool, shape=(None, H, K, None), floating=True)
    if V != K:
        raise ValueError(f"state_pool has shape {tuple(state_pool.shape)}; its value width must be v's {K}")
    check_tensor("slots", slots, shape=(B,), integer=True)
    return B, H, K, V


def kda_decode_ref(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   lower_bound: float, state_pool: torch.Tensor, slots: torch.Tensor,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B, 3, H, K], z [B, H*K], b [B, H], A_log [>= H], dt_bias [H*K], state_pool [S, H, K, K] (read only),
    slots int [B] -> (o [B, H, K] in qkv's dtype, the new states [B, H, K, K] fp32; fp64 for fp64 inputs)."""
    check_decode(qkv, z, b, A_log, dt_bias, state_pool, slots)
    q, k, v, g, beta = kda_step_inputs(qkv, z, b, A_log, dt_bias, lower_bound)
    o, state = kda_recurrent_ref(*(x.unsqueeze(1) for x in (q, k, v, g, beta)), scale, state_pool[slots.long()])
    return o.squeeze(1), state
