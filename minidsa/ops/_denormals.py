"""Subnormal floats on the CPU: flushed to zero around the ops that make them, and kept out of exp's
arguments (docs/design.md §5).

KDA's chunk form multiplies by exp(G), G the cumulative log-decay inside a chunk: with decays of -2.7 a step
(seen in the laptop model; the floor is -5) G reaches about -170 over 64 steps, so exp(G) and the products
built from it fall below fp32's normal range (1.2e-38) into subnormal numbers. x86 CPUs handle a subnormal
operand or result in microcode, many times slower than a normal one (docs/log.md has the measurement).
Flushing changes only values below 1.2e-38 (fp32) or 2.2e-308 (fp64), which no output of these ops can show.

``torch.set_flush_denormal`` sets the calling thread's floating-point mode (x86: FTZ and DAZ) and has no
getter, so the mode in force is probed (a subnormal constant read as zero) and restored after.

The flush mode does not help ``exp`` itself: torch's vectorised CPU exp sends every argument whose result
would be subnormal or zero (below ln(1.2e-38) = -87.34 in fp32, -inf included) to a scalar path, 20 to 80
times slower a lane, whatever the mode. ``floored_exp`` takes such arguments at -87 instead: e^-87 =
1.6e-38 where the true value is smaller, a difference below the last bit of any sum of normal-sized terms it
enters. Exact zeros (masked pairs, masked keys) are made by a multiplication after it, not by -inf before.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _flushing() -> bool:
    """Whether this thread already reads subnormal floats as zero."""
    return float(torch.tensor([1e-39], dtype=torch.float32) * 1.0) == 0.0


EXP_FLOOR = -87.0  # e^-87 = 1.6e-38: the lowest argument fp32's exp keeps normal, with a margin


def floored_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(max(x, -87)) in a new tensor: exp of a log-decay or a score difference, never its slow path.
    NaN propagates."""
    return x.clamp_min(EXP_FLOOR).exp_()


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
