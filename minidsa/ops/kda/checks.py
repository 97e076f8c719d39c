"""Argument checks of the KDA recurrences, shared by the references, the CPU form and the kernels.

Shapes and dtypes are always checked; values (state_at pairs, lengths) only where reading them costs no device
sync (``on_host``).
"""

from __future__ import annotations

import torch

from .._checks import check_tensor, on_host


def check_recurrence(q, k, v, g, beta, initial_state):
    """Shapes of the recurrences' inputs (``kda_recurrent``, ``kda_chunk``) -> (B, T, H, K, HV, V)."""
    B, T, H, K = check_tensor("q", q, ndim=4, floating=True)
    check_tensor("k", k, shape=(B, T, H, K), floating=True)
    _, _, HV, V = check_tensor("v", v, shape=(B, T, None, None), floating=True)
    if HV % H:
        raise ValueError(f"v has {HV} heads; it must be a multiple of q's {H} heads")
    check_tensor("g", g, shape=(B, T, HV, K), floating=True)
    check_tensor("beta", beta, shape=(B, T, HV), floating=True)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, shape=(B, HV, K, V), floating=True)
    return B, T, H, K, HV, V


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def check_state_at(state_at, B: int, T: int, chunk_size: int) -> None:
    """``state_at`` int [M, 2]: (row b, position t) pairs whose state ``kda_chunk`` also returns. A row of -1 is
    padding (its state comes back as zeros); t must be a multiple of ``chunk_size`` in [0, T], or T itself, and
    no pair may repeat.
    Values are checked where that costs no device sync (``on_host``). None passes."""
    if state_at is None:
        return
    check_tensor("state_at", state_at, ndim=2, integer=True)
    if state_at.shape[1] != 2:
        raise ValueError(f"state_at must be [M, 2] (row, position) pairs, got shape {tuple(state_at.shape)}")
    if on_host(state_at) and state_at.numel():
        row, t = state_at.unbind(1)
        real = row >= 0
        bad = real & ((row >= B) | (t < 0) | (t > T) | ((t % chunk_size != 0) & (t != T)))
        if bool(bad.any()):
            r, p = state_at[bad.nonzero()[0, 0]].tolist()
            raise ValueError(f"state_at pair (row {r}, position {p}) is not a row < {B} and a position in [0, {T}] "
                             f"that is a multiple of chunk_size = {chunk_size} or {T}; pass -1 as the row to skip it")
        pairs = state_at[real]
        if pairs.unique(dim=0).shape[0] != pairs.shape[0]:
            raise ValueError("state_at names a (row, position) pair twice; each kept state is asked for once")


def check_lengths(lengths, B: int, T: int) -> torch.Tensor:
    """``lengths`` int [B] in [0, T] (values checked where that costs no sync) -> int64 [B]."""
    check_tensor("lengths", lengths, shape=(B,), integer=True)
    if on_host(lengths) and B and not bool(((lengths >= 0) & (lengths <= T)).all()):
        raise ValueError(f"lengths must lie in [0, {T}] (the row length), got {lengths.tolist()}")
    return lengths.long()
