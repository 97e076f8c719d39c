"""What both KDA kernel families (``recurrent_triton.py``, ``chunk_triton.py``) read and write alike.

Device side (``@triton.jit``, inlined into the kernels): the load of a program's [BK, BV] fp32 state
tile, with the offsets and mask its final store reuses, and the load of one token's row of a
contiguous [B, T, heads, width] input. Host side: the output allocation (o in v's dtype, a NEW fp32
state), the result state when no step runs, and the fp64 test that sends exactness tests to the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import acc_dtype


@triton.jit
def load_state(s0_ptr, bh, K, V, d, e, BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr):
    """The [BK, BV] fp32 tile (key rows d, value columns e) of state bh, zeros without an initial
    state; also its offsets and mask, for the store of the final state at the same place."""
    state_offs = bh * K * V + d[:, None] * V + e[None, :]
    state_mask = (d < K)[:, None] & (e < V)[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    return S, state_offs, state_mask


@triton.jit
def token_row(ptr, bT, t, mask, head, n_heads, width, d):
    """fp32 row [len(d)] of token ``bT + t`` (a scalar) of one head; zero where ``mask`` is False."""
    offs = ((bT + t) * n_heads + head) * width + d
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


def new_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised o [B, T, HV, V] in v's dtype and a NEW fp32 final state [B, HV, K, V]."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    return (torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device),
            torch.empty(B, HV, K, V, dtype=torch.float32, device=v.device))


def copy_state(initial_state, out):
    """The result state when no step runs: a fresh fp32 copy (or zeros), never the caller's tensor."""
    return out.zero_() if initial_state is None else out.copy_(initial_state)


def wants_reference(q, k, v, g, beta, initial_state) -> bool:
    """fp64 anywhere: the exactness tests' contract (fp64 math, fp64 state) belongs to the reference."""
    extra = [initial_state] if initial_state is not None else []
    return acc_dtype(q, k, v, g, beta, *extra) == torch.float64
