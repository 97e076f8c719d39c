"""The Triton kernels as ``torch.library`` custom ops, so that ``torch.compile`` can trace around them.

Dynamo cannot look inside a Triton launcher that builds its grid on the host, reads tensor strides and
picks a variant, and Inductor must not try. Registered as an opaque op ``minidsa::<name>`` with a fake
implementation (output shapes and dtypes from input shapes alone), a kernel becomes one node of the traced
graph: ``torch.compile(fullgraph=True)`` fuses the glue around it and a CUDA graph captures it like any
other launch. Eager calls skip the registered op and call the kernel directly: the dispatcher's few
microseconds per call are pure host cost on a decode step that is already bound by launches.

The schema and the fake come from each op's one registration (``ops._dispatch.op``: the schema from the
reference's annotations; tests/ops/test_library.py checks both against the kernels). The references are
plain PyTorch and are traced as they are.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

NAMESPACE = "minidsa"


def result_like(like: torch.Tensor, shape, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty result for a fake; by default in the ops' accumulation dtype: fp32, fp64 for fp64 inputs."""
    return like.new_empty(tuple(shape), dtype=dtype or (torch.float64 if like.dtype == torch.float64 else torch.float32))


@functools.lru_cache(maxsize=None)
def custom_op(op: str, kernel: Callable, schema: str, mutates: tuple[str, ...], fake: Callable) -> Callable:
    """``kernel`` (the Triton implementation of ``op``) registered once as ``torch.ops.minidsa.<op>``, with the
    schema and the fake its registration (``ops._dispatch.op``) gives."""
    registered = torch.library.custom_op(f"{NAMESPACE}::{op}", kernel, mutates_args=mutates, schema=schema)
    registered.register_fake(fake)
    return registered
