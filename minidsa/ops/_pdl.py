"""What the GPU can do: its capability, and the switch for programmatic dependent launch.

Programmatic dependent launch (PDL, sm_90 and later): a kernel launched as a programmatic dependent of
the kernel before it may start while that one finishes, and must execute ``griddepcontrol.wait`` (Triton's
``gdc_wait``) before it reads anything an earlier kernel wrote or writes anything an earlier kernel reads;
the wait returns once the earlier grid has completed and its writes are visible.

A decode step is hundreds of kernels of a few microseconds each, so the start of each (launch, address
arithmetic, the first DRAM round trip) is a large part of its time. A kernel whose first loads read only
weights (which no kernel of the step writes) issues them before its wait: they stream while the kernel
before it runs its last blocks. ``gdc_launch_dependents`` early in such a kernel lets the next one launch
as soon as every block of this one has started, instead of when the last block exits.

``MINIDSA_PDL=0`` launches every such kernel as an ordinary one (the kernels then skip their wait).

The Gluon kernels (``ops/mla/*_gluon.py``), written for sm_90's warp groups, are a backend of their own
(``backend="gluon"``, and "auto" on a capability-9.0 GPU: ops/_dispatch.py); ``backend="triton"`` keeps every
call on the Triton kernels.
"""

from __future__ import annotations

import functools
import os

import torch

USE_PDL = os.environ.get("MINIDSA_PDL", "1") != "0"


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched as programmatic dependents (USE_PDL, sm_90 or later)."""
    return USE_PDL and device.type == "cuda" and capability(device.index) >= (9, 0)


def launch_options(on: bool) -> dict:
    """The extra launch keyword of a Triton kernel launched with PDL ``on``."""
    return {"launch_pdl": True} if on else {}


@functools.lru_cache(maxsize=None)  # cached: a query costs microseconds of host time, and every launch asks
def capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)
