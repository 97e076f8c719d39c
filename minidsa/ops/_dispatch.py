"""Backend selection shared by every public op.

Each op has a PyTorch reference (always available, fp32 math) and, where it is a hot path, a
Triton kernel with the same signature. ``backend="auto"`` takes the kernel when one is registered,
Triton imports, and the inputs live on a GPU; otherwise the reference.
"""

from __future__ import annotations

from typing import Callable

BACKENDS = ("torch", "triton", "auto")

# op name -> Triton implementation; filled by minidsa.ops.triton modules when they exist.
TRITON_KERNELS: dict[str, Callable] = {}


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pick(op: str, backend: str, reference: Callable, *tensors) -> Callable:
    """Return the implementation of ``op`` for ``backend``; raise ValueError naming the fix."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} for {op}; use one of {BACKENDS}")
    if backend == "torch":
        return reference
    kernel = TRITON_KERNELS.get(op)
    if backend == "triton":
        if kernel is None:
            raise ValueError(f"{op} has no Triton kernel yet; use backend='torch' or 'auto'")
        if not triton_available():
            raise ValueError(f"backend='triton' for {op} but triton is not installed; "
                             f"pip install 'minidsa[triton]' (Linux) or use backend='torch'")
        return kernel
    on_gpu = any(getattr(t, "is_cuda", False) for t in tensors)
    if kernel is not None and on_gpu and triton_available():
        return kernel
    return reference
