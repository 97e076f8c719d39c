"""Host side of the chunk kernels (``chunk_triton.py``): their scratch tensors and the table that tells the
state walk which states to keep. Plain PyTorch on the device: nothing here waits for the GPU, so a CUDA
graph can hold a step that calls them."""

from __future__ import annotations

import torch
import triton.language as tl


def keep_table(state_at, B: int, T: int, C: int, NT: int) -> torch.Tensor:
    """int32 [B, NT + 1]: at (row, chunk), the index in ``state_at`` of the pair asking for the state at that
    chunk's start (chunk NT: the end), else -1. Built on the device: no host sync, so a graph can hold it."""
    row, t = state_at.long().unbind(1)
    chunk = torch.where(t >= T, NT, t.clamp_min(0) // C)
    sink = B * (NT + 1)  # padding pairs land past the table
    flat = torch.where(row >= 0, row * (NT + 1) + chunk, sink)
    table = torch.full((sink + 1,), -1, dtype=torch.int32, device=state_at.device)
    table.scatter_(0, flat, torch.arange(state_at.shape[0], dtype=torch.int32, device=state_at.device))
    return table


def scratch(BH: int, NT: int, BC: int, BK: int, BVF: int, v: torch.Tensor, dot) -> dict:
    """The kernels' scratch tensors, [B*HV, NT*BC, width] each (per chunk: decay [.., NT, BK], S0 [.., NT, BK, BVF]).

    Scratch that is only ever a dot operand is stored in the dots' operand type (bf16 for bf16 inputs): the
    kernels would convert it right after loading, so this halves its bytes and changes no result. G, U and
    A_kk stay fp32 (exponents, a subtraction, the exact solve)."""
    f32 = dict(dtype=torch.float32, device=v.device)
    dt = dict(dtype=v.dtype if dot != tl.float32 else torch.float32, device=v.device)  # dot: v's type
    rows = NT * BC
    return dict(G=torch.empty(BH, rows, BK, **f32), qg=torch.empty(BH, rows, BK, **dt),
                kd=torch.empty(BH, rows, BK, **dt), w=torch.empty(BH, rows, BK, **dt),
                u=torch.empty(BH, rows, BVF, **f32), v_new=torch.empty(BH, rows, BVF, **dt),
                aqk=torch.empty(BH, rows, BC, **dt), akk=torch.empty(BH, rows, BC, **f32),
                decay=torch.empty(BH, NT, BK, **f32), s0=torch.empty(BH, NT, BK, BVF, **dt))
