"""Backend selection for every public op, decided in one place.

Each op has a PyTorch reference in ``minidsa/ops/<op>/reference.py`` (always available, fp32 math)
and, where it is a hot path, a Triton kernel beside it in ``minidsa/ops/<op>/<name>_triton.py`` with
the same signature. The table ``TRITON_KERNELS`` below is the only place that says which kernel backs which op; kernel
modules are imported the first time they are picked, so importing minidsa never imports triton. ``CPU_FORMS``
names the ops with a faster plain-PyTorch form for CPU tensors (``<op>/<name>_cpu.py``), which "auto" runs there.

The backend in force comes from ``use_backend(...)`` (a context manager; ``model.set_backend``
enters it around every forward) or ``set_backend(...)`` (process-wide default), unless an op call
passes ``backend=`` itself. ``backend="triton"`` passed to one op is strict (an op without a kernel
raises); "triton" in force for a whole model runs every registered kernel and the references of the
ops that have none yet. See docs/design.md §12.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
from typing import Callable, Iterator

import torch

from ._library import custom_op

BACKENDS = ("torch", "triton", "auto")

# op name -> (module, function) of the Triton kernel that implements it, with the reference's signature.
# Each entry is checked against its reference by a test (tests/ops/test_paged_ops.py).
TRITON_KERNELS: dict[str, tuple[str, str]] = {
    "store_kv": ("minidsa.ops.kv_store.store_triton", "store_kv"),
    "index_scores": ("minidsa.ops.indexer.scores_triton", "index_scores"),
    "paged_index_scores": ("minidsa.ops.indexer.scores_triton", "paged_index_scores"),
    "topk_indices": ("minidsa.ops.indexer.topk_triton", "topk_indices"),
    "sparse_mla_decode": ("minidsa.ops.mla.latent_triton", "sparse_mla_decode"),
    "sparse_mla_prefill": ("minidsa.ops.mla.prefill_triton", "sparse_mla_prefill"),
    "kda_recurrent": ("minidsa.ops.kda.recurrent_triton", "kda_recurrent"),
    "kda_chunk": ("minidsa.ops.kda.chunk_triton", "kda_chunk"),
    "kda_decode": ("minidsa.ops.kda.decode_triton", "kda_decode"),
    "mxfp4_to_fp8": ("minidsa.ops.moe_experts.convert_triton", "mxfp4_to_fp8"),
    "expert_mlp_fp8": ("minidsa.ops.moe_experts.mlp_triton", "expert_mlp_fp8"),
    "expert_mlp_mxfp4": ("minidsa.ops.moe_experts.mlp_triton", "expert_mlp_mxfp4"),
    "situ_glu": ("minidsa.ops.activation.situ_glu_triton", "situ_glu"),
    "linear": ("minidsa.ops.linear.gemv_triton", "linear"),
    "linear_sum": ("minidsa.ops.linear.gemv_triton", "linear_sum"),
    "moe_route": ("minidsa.ops.moe_router.route_triton", "moe_route"),
    "moe_plan": ("minidsa.ops.moe_router.plan_triton", "moe_plan"),
    "situ_glu_backward": ("minidsa.ops.activation.situ_glu_triton", "situ_glu_backward"),
    "attn_res_mix": ("minidsa.ops.attn_res.mix_triton", "attn_res_mix"),
    "short_conv": ("minidsa.ops.kda.conv_triton", "short_conv"),
    "rms_norm": ("minidsa.ops.norm.rms_triton", "rms_norm"),
    "output_gate": ("minidsa.ops.gate.gate_triton", "output_gate"),
    "kda_inputs": ("minidsa.ops.kda.inputs_triton", "kda_inputs"),
}

# op -> (module, function) of a faster plain-PyTorch form for CPU tensors, with the reference's signature
# and result (the same parity tests hold it to the reference): "auto" picks it when no input is on a GPU.
CPU_FORMS: dict[str, tuple[str, str]] = {
    "topk_indices": ("minidsa.ops.indexer.topk_cpu", "topk_indices"),
    "paged_index_scores": ("minidsa.ops.indexer.scores_cpu", "paged_index_scores"),
    "mxfp4_to_fp8": ("minidsa.ops.moe_experts.cpu", "mxfp4_to_fp8"),
    "expert_mlp_fp8": ("minidsa.ops.moe_experts.cpu", "expert_mlp_fp8"),
    "expert_mlp_mxfp4": ("minidsa.ops.moe_experts.cpu", "expert_mlp_mxfp4"),
    "kda_chunk": ("minidsa.ops.kda.chunk_cpu", "kda_chunk"),
}

_default = "auto"
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("minidsa_backend", default=None)


def check_backend(backend: str, what: str = "backend") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{what}={backend!r}; use one of {BACKENDS}")
    return backend


def set_backend(backend: str) -> None:
    """Process-wide default backend ("auto" at import)."""
    global _default
    _default = check_backend(backend)


@torch.compiler.assume_constant_result  # torch.compile reads it once per trace: the backend is baked in
def current_backend() -> str:
    """The backend an op uses when it is not given one: the innermost ``use_backend``, else the default."""
    return _current.get() or _default


@contextlib.contextmanager
def use_backend(backend: str | None) -> Iterator[None]:
    """``with ops.use_backend("torch"): ...`` runs every op inside on that backend (None: leave it as is)."""
    if backend is None:
        yield
        return
    token = _current.set(check_backend(backend))
    try:
        yield
    finally:
        _current.reset(token)


# Whether triton is importable, looked up when this module is imported: torch.compile cannot trace importlib, and
# the first call may come from inside a compiled step.
_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON


# op -> its kernel as the custom op torch.ops.minidsa.<op> (ops/_library.py): what a torch.compile trace calls
_CUSTOM_OPS: dict[str, Callable] = {}


def load_kernel(op: str) -> Callable:
    """Import the Triton kernel registered for ``op`` (raises KeyError when none is). While ``torch.compile``
    traces, the kernel as the custom op ``torch.ops.minidsa.<op>`` instead (ops/_library.py); eager calls
    register it, ``register_custom_ops`` registers all."""
    if torch.compiler.is_compiling():
        if op not in _CUSTOM_OPS:
            raise RuntimeError(f"the Triton kernel of {op} is not registered as a custom op yet; call "
                               f"minidsa.ops.register_custom_ops() before torch.compile")
        return _CUSTOM_OPS[op]
    module, name = TRITON_KERNELS[op]
    kernel = getattr(importlib.import_module(module), name)
    if op not in _CUSTOM_OPS:
        _CUSTOM_OPS[op] = custom_op(op, kernel)
    return kernel


def register_custom_ops() -> None:
    """Register every Triton kernel as a ``torch.library`` custom op with its fake implementation, so that
    ``torch.compile(fullgraph=True)`` traces through any op (needs triton)."""
    for op in TRITON_KERNELS:
        load_kernel(op)


def pick(op: str, backend: str | None, reference: Callable, *tensors) -> Callable:
    """The implementation of ``op`` for ``backend`` (None: the current one); ValueError names the fix."""
    explicit = backend is not None
    backend = check_backend(current_backend() if backend is None else backend, f"backend for {op}")
    if backend == "torch":
        return reference
    registered = op in TRITON_KERNELS
    # The kernels are forward-only: under autograd a kernel would return a result with no gradient path,
    # silently freezing everything upstream of it. Recorded calls therefore run the reference.
    recording = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)
    if backend == "triton":
        if not registered or recording:
            if not explicit:  # a model-wide "triton": every kernel there is, references for the rest
                return reference
            if recording:
                raise ValueError(f"the Triton kernel of {op} has no backward, but its inputs require grad; "
                                 f"use backend='torch' or 'auto' to train through it, or run under torch.no_grad()")
            raise ValueError(f"{op} has no Triton kernel yet; use backend='torch' or 'auto'")
        if not triton_available():
            raise ValueError(f"backend='triton' for {op} but triton is not installed; "
                             f"pip install 'minidsa[triton]' (Linux) or use backend='torch'")
        return load_kernel(op)
    on_gpu = any(getattr(t, "is_cuda", False) for t in tensors)
    if registered and on_gpu and not recording and triton_available():
        return load_kernel(op)
    if op in CPU_FORMS and not on_gpu:  # plain PyTorch, differentiable like the reference
        module, name = CPU_FORMS[op]
        return getattr(importlib.import_module(module), name)
    return reference
