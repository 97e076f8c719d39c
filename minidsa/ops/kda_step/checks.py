"""Argument checks of the KDA step ops, shared by their references and kernels: shapes and dtypes only, so
they never read a tensor's values (no host synchronisation)."""

from __future__ import annotations

from .._checks import check_tensor


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


def check_inputs(qkv, z, b) -> tuple[int, int]:
    """(H, K) after checking ``kda_inputs``'s arguments."""
    shape = check_tensor("qkv", qkv, floating=True)
    if len(shape) < 3 or shape[-3] != 3:
        raise ValueError(f"qkv must be [..., 3, H, K] (q, k, v), got shape {tuple(shape)}")
    H, K = shape[-2:]
    check_tensor("z", z, shape=(*shape[:-3], H * K), floating=True)
    check_tensor("b", b, shape=(*shape[:-3], H), floating=True)
    return H, K


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
