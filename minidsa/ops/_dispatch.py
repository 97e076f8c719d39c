"""Backend selection for every public op, decided in one place.

Each op has a PyTorch reference in ``minidsa/ops/<op>/reference.py`` (always available, fp32 math)
and, where it is a hot path, a Triton kernel beside it in ``minidsa/ops/<op>/<name>_triton.py`` with
the same signature. ``op`` registers the reference as the public op where it is written, naming its kernel,
its CPU form (a faster plain-PyTorch form for CPU tensors, ``<op>/<name>_cpu.py``, which "auto" runs there) and
its fake; that registration is the only place that says which kernel backs which op. Kernel modules are
imported the first time they are picked, so importing minidsa never imports triton.

The backend in force comes from ``use_backend(...)`` (a context manager; ``model.set_backend``
enters it around every forward) or ``set_backend(...)`` (process-wide default), unless an op call
passes ``backend=`` itself. ``backend="triton"`` passed to one op is strict (an op without a kernel
raises); "triton" in force for a whole model runs every registered kernel and the references of the
ops that have none yet. See docs/design.md §12.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.util
import inspect
from typing import Callable, Iterator

import torch

from ._library import custom_op

BACKENDS = ("torch", "triton", "auto")

# Filled by ``op`` as the reference modules are imported: op name -> its registration, and the three views the
# dispatch reads (the kernel and the CPU form of an op are functions of the op's name in the named module).
OPS: dict[str, "OpSpec"] = {}
REFERENCES: dict[str, Callable] = {}  # op -> its plain PyTorch reference
TRITON_KERNELS: dict[str, tuple[str, str]] = {}  # op -> (module, function) of its Triton kernel
CPU_FORMS: dict[str, tuple[str, str]] = {}  # op -> (module, function) of its faster CPU form, which "auto" runs


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
        spec = OPS[op]
        _CUSTOM_OPS[op] = custom_op(op, kernel, spec.schema, spec.mutates, spec.fake)
    return kernel


def register_custom_ops() -> None:
    """Register every Triton kernel as a ``torch.library`` custom op with its fake implementation, so that
    ``torch.compile(fullgraph=True)`` traces through any op (needs triton)."""
    for op in TRITON_KERNELS:
        load_kernel(op)


@dataclasses.dataclass
class OpSpec:
    """One op as ``op`` registers it: what the dispatch, ``torch.library`` and the tests read."""

    name: str
    reference: Callable  # the formula (``<op>/reference.py``); the tests' spies replace it here
    schema: str  # the custom op's schema, from the reference's annotations
    mutates: tuple[str, ...]  # arguments written in place
    fake: Callable | None  # output shapes and dtypes from input shapes (for torch.compile)
    call: Callable | None  # how the public op calls its implementation, where that is more than a call


def op(*, kernel: str | None = None, cpu: str | None = None, fake: Callable | None = None, mutates=(),
       call: Callable | None = None, returns: str | None = None) -> Callable:
    """Register the decorated reference as the public op of its name: ``ops.<name>(..., backend=None)``.

    ``kernel`` / ``cpu``: the module (relative to the reference's package) holding the Triton kernel / the fast CPU
    form, a function of the op's name with the reference's signature. ``fake``: the kernel's output shapes for
    ``torch.compile``. ``mutates``: arguments the op writes. ``call(impl, *args, **kwargs)``: where the public op
    does more than call the implementation it picked (a thread setting around it, a result cut to what was asked).
    ``returns``: the schema's result where the reference's annotation cannot say it. The undecorated reference
    stays callable as ``<op>.reference``; the schema comes from its annotations."""
    def register(reference: Callable) -> Callable:
        name, package = reference.__name__, reference.__module__.rsplit(".", 1)[0]
        spec = OpSpec(name, reference, schema_of(reference, mutates, returns), tuple(mutates), fake, call)
        OPS[name], REFERENCES[name] = spec, reference
        if kernel:
            TRITON_KERNELS[name] = (f"{package}.{kernel}", name)
        if cpu:
            CPU_FORMS[name] = (f"{package}.{cpu}", name)

        @functools.wraps(reference)
        def public(*args, backend: str | None = None, **kwargs):
            # pick reads the arguments' devices and grad flags; a non-tensor has neither (a decode step makes
            # hundreds of these calls: no list of the tensors is built)
            impl = pick(name, backend, spec.reference, *args, *kwargs.values())
            return impl(*args, **kwargs) if spec.call is None else spec.call(impl, *args, **kwargs)
        public.reference = reference
        params = inspect.signature(reference).parameters.values()  # what help() shows: the reference's, + backend
        backend = inspect.Parameter("backend", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None")
        public.__signature__ = inspect.signature(reference).replace(parameters=[*params, backend])
        return public
    return register


_SCHEMA_TYPES = {"torch.Tensor": "Tensor", "float": "float", "int": "int", "bool": "bool", "torch.dtype": "ScalarType"}


def schema_of(fn: Callable, mutates=(), returns: str | None = None) -> str:
    """``torch.library`` schema of ``fn`` from its annotations (strings under ``from __future__ import
    annotations``): ``Tensor``, ``float``, ``int``, ``bool``, ``torch.dtype``, each optional as ``X | None``, and
    a result of ``torch.Tensor``, ``None`` or ``tuple[torch.Tensor, ...]`` of a fixed length."""
    def one(annotation: str, what: str) -> str:
        base = annotation.removesuffix(" | None")
        if base not in _SCHEMA_TYPES:
            raise TypeError(f"{fn.__qualname__}: {what} is annotated {annotation!r}; a registered op takes "
                            f"{sorted(_SCHEMA_TYPES)}, each optionally '| None'")
        return _SCHEMA_TYPES[base] + ("?" if base != annotation else "")
    args, alias = [], iter("abcdefgh")
    for p in inspect.signature(fn).parameters.values():
        kind = one(str(p.annotation), p.name) + (f"({next(alias)}!)" if p.name in mutates else "")
        args.append(f"{kind} {p.name}" + ("" if p.default is p.empty else f"={p.default!r}"))
    if returns is None:
        ret = str(inspect.signature(fn).return_annotation)
        inner = ret[len("tuple["):-1].split(", ") if ret.startswith("tuple[") else [] if ret == "None" else [ret]
        returns = "(" + ", ".join(one(t, "its result") for t in inner) + ")" if ret != "torch.Tensor" else "Tensor"
    return f"({', '.join(args)}) -> {returns}"


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
    on_gpu = next((t.is_cuda for t in tensors if isinstance(t, torch.Tensor)), False)  # an op's tensors share a device
    if registered and on_gpu and not recording and triton_available():
        return load_kernel(op)
    if op in CPU_FORMS and not on_gpu:  # plain PyTorch, differentiable like the reference
        module, name = CPU_FORMS[op]
        return getattr(importlib.import_module(module), name)
    return reference
