"""Argument checks that name the offending tensor, shared by the ops."""

from __future__ import annotations

import torch


def check_tensor(name: str, t, *, ndim: int | None = None, shape: tuple | None = None,
                 floating: bool = False, integer: bool = False) -> tuple[int, ...]:
    """Validate ``t`` and return its shape. ``shape`` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; dim {i} must be {want}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    return tuple(t.shape)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, but a tensor already in ``dtype`` comes back without a dispatched op: the decode
    step of a small model makes hundreds of such calls per token, and each costs about a microsecond."""
    return t if t.dtype == dtype else t.to(dtype)


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Accumulation dtype everywhere in minidsa: fp32, or fp64 when an input is fp64 (for exactness tests)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# Value checks on CPU data are free; a test switches them off to show that a decode step reads
# nothing else back from its tensors (tests/model/test_decode_sync.py).
CHECK_VALUES_ON_HOST = True


def on_host(*tensors: torch.Tensor) -> bool:
    """True when every tensor lives in CPU memory, so checking its values costs no device sync.

    Ops check data-dependent conditions (NaN scores, out-of-range indices) only then: on a GPU the
    same check would stall the host on every call and make a decode step impossible to capture in a
    CUDA graph (docs/design.md §14). Shapes and dtypes are always checked.
    """
    return CHECK_VALUES_ON_HOST and all(t.device.type == "cpu" for t in tensors)
