"""Subnormal floats flushed to zero around the CPU ops that make them (docs/design.md §5).

KDA's chunk form multiplies by exp(G), G the cumulative log-decay inside a chunk: with decays of -2.7 a step
(seen in the laptop model; the floor is -5) G reaches about -170 over 64 steps, so exp(G) and the products
built from it fall below fp32's normal range (1.2e-38) into subnormal numbers. x86 CPUs handle a subnormal
operand or result in microcode, many times slower than a normal one (docs/log.md has the measurement).
Flushing changes only values below 1.2e-38 (fp32) or 2.2e-308 (fp64), which no output of these ops can show.

``torch.set_flush_denormal`` sets the calling thread's floating-point mode (x86: FTZ and DAZ) and has no
getter, so the mode in force is probed (a subnormal constant read as zero) and restored after.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _flushing() -> bool:
    """Whether this thread already reads subnormal floats as zero."""
    return float(torch.tensor([1e-39], dtype=torch.float32) * 1.0) == 0.0


@contextlib.contextmanager
def flush_denormals(t: torch.Tensor) -> Iterator[None]:
    """Within: subnormal floats are zero on this thread, when ``t`` is in CPU memory (a no-op elsewhere)."""
    if t.device.type != "cpu" or _flushing() or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
