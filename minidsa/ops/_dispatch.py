"""Backend selection for every public op, decided in one place.

Each op has a PyTorch reference in ``minidsa/ops/<op>/reference.py`` (always available, fp32 math)
and, where it is a hot path, a Triton kernel beside it in ``minidsa/ops/<op>/<name>_triton.py`` with
the same signature. ``op`` registers the reference as the public op where it is written, naming its kernel,
its CPU form (a faster plain-PyTorch form for CPU tensors, ``<op>/<name>_cpu.py``, which "auto" runs there), its
sm_90 form (``<op>/<name>_gluon.py``: Gluon kernels written for Hopper's warp groups, for the calls they fit, and
the Triton kernel for the rest) and its fake; that registration is the only place that says which kernel backs
which op. Kernel modules are imported the first time they are picked, so importing minidsa never imports triton.

The backend in force comes from ``use_backend(...)`` (a context manager; ``model.set_backend``
enters it around every forward) or ``set_backend(...)`` (process-wide default), unless an op call
passes ``backend=`` itself. The backends: "torch" the references; "triton" the Triton kernels; "gluon" the sm_90
forms (on a capability-9.0 GPU); "auto" the sm_90 form where there is one and the GPU runs it, else the Triton
kernel, on a GPU, and the CPU form, else the reference, on a CPU. A backend passed to one op is strict (an op
without that kernel raises); "triton" or "gluon" in force for a whole model runs every kernel of that kind there
is, then (for "gluon") the Triton kernels, then the references. See docs/design.md §12.
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
from ._pdl import capability

BACKENDS = ("torch", "triton", "gluon", "auto")

# Filled by ``op`` as the reference modules are imported: op name -> its registration, and the four views the
# dispatch reads (an op's kernel, CPU form and sm_90 form are functions of the op's name in the named module).
OPS: dict[str, "OpSpec"] = {}
REFERENCES: dict[str, Callable] = {}  # op -> its plain PyTorch reference
TRITON_KERNELS: dict[str, tuple[str, str]] = {}  # op -> (module, function) of its Triton kernel
CPU_FORMS: dict[str, tuple[str, str]] = {}  # op -> (module, function) of its faster CPU form, which "auto" runs
GLUON_KERNELS: dict[str, tuple[str, str]] = {}  # op -> (module, function) of its sm_90 form


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


# (op, device index) -> gluon_runs(op, device index). A plain dict, not functools.lru_cache: Dynamo would trace
# through an lru_cache wrapper, and gluon_runs is a property of the machine that a compiled step bakes in.
_GLUON_RUNS: dict[tuple[str, int | None], bool] = {}


@torch.compiler.assume_constant_result
def gluon_runs(op: str, device_index: int | None) -> bool:
    """Whether the sm_90 form of ``op`` runs on CUDA device ``device_index``: capability exactly 9.0 (its Gluon
    kernels use Hopper's warp-group instructions) and a triton with the Gluon API they are written against."""
    key = (op, device_index)
    if key not in _GLUON_RUNS:
        runs = _TRITON and capability(device_index) == (9, 0)
        if runs:
            try:
                importlib.import_module(GLUON_KERNELS[op][0])
            except (ImportError, AttributeError):  # a triton without Gluon, or with another Gluon API
                runs = False
        _GLUON_RUNS[key] = runs
    return _GLUON_RUNS[key]


# (op, "triton" or "gluon") -> that kernel as the custom op torch.ops.minidsa.<op>[_gluon] (ops/_library.py): what a
# torch.compile trace calls
_CUSTOM_OPS: dict[tuple[str, str], Callable] = {}


def load_kernel(op: str, kind: str = "triton") -> Callable:
    """Import the kernel of ``kind`` ("triton", "gluon") registered for ``op`` (raises KeyError when none is).
    While ``torch.compile`` traces, the kernel as the custom op ``torch.ops.minidsa.<op>`` (``<op>_gluon``)
    instead (ops/_library.py); eager calls register it, ``register_custom_ops`` registers all."""
    if torch.compiler.is_compiling():
        if (op, kind) not in _CUSTOM_OPS:
            raise RuntimeError(f"the {kind} kernel of {op} is not registered as a custom op yet; call "
                               f"minidsa.ops.register_custom_ops() before torch.compile")
        return _CUSTOM_OPS[op, kind]
    module, name = (TRITON_KERNELS if kind == "triton" else GLUON_KERNELS)[op]
    kernel = getattr(importlib.import_module(module), name)
    if (op, kind) not in _CUSTOM_OPS:
        spec = OPS[op]
        _CUSTOM_OPS[op, kind] = custom_op(op if kind == "triton" else f"{op}_{kind}", kernel, spec.schema,
                                          spec.mutates, spec.fake)
    return kernel


def register_custom_ops() -> None:
    """Register every Triton kernel (and, where a GPU runs them, every sm_90 form) as a ``torch.library`` custom
    op with its fake implementation, so that ``torch.compile(fullgraph=True)`` traces through any op (needs
    triton)."""
    for op in TRITON_KERNELS:
        load_kernel(op)
    for op in GLUON_KERNELS:
        if torch.cuda.is_available() and gluon_runs(op, torch.cuda.current_device()):
            load_kernel(op, "gluon")


@dataclasses.dataclass
class OpSpec:
    """One op as ``op`` registers it: what the dispatch, ``torch.library`` and the tests read."""

    name: str
    reference: Callable  # the formula (``<op>/reference.py``); the tests' spies replace it here
    schema: str  # the custom op's schema, from the reference's annotations
    mutates: tuple[str, ...]  # arguments written in place
    fake: Callable | None  # output shapes and dtypes from input shapes (for torch.compile)
    call: Callable | None  # how the public op calls its implementation, where that is more than a call


def op(*, kernel: str | None = None, cpu: str | None = None, gluon: str | None = None, fake: Callable | None = None,
       mutates=(), call: Callable | None = None, returns: str | None = None) -> Callable:
    """Register the decorated reference as the public op of its name: ``ops.<name>(..., backend=None)``.

    ``kernel`` / ``cpu`` / ``gluon``: the module (relative to the reference's package) holding the Triton kernel /
    the fast CPU form / the sm_90 form, a function of the op's name with the reference's signature. ``fake``: the
    kernel's output shapes for ``torch.compile``. ``mutates``: arguments the op writes. ``call(impl, *args,
    **kwargs)``: where the public op does more than call the implementation it picked (a thread setting around
    it, a result cut to what was asked). ``returns``: the schema's result where the reference's annotation cannot
    say it. The undecorated reference stays callable as ``<op>.reference``; the schema comes from its annotations."""
    def register(reference: Callable) -> Callable:
        name, package = reference.__name__, reference.__module__.rsplit(".", 1)[0]
        spec = OpSpec(name, reference, schema_of(reference, mutates, returns), tuple(mutates), fake, call)
        OPS[name], REFERENCES[name] = spec, reference
        if kernel:
            TRITON_KERNELS[name] = (f"{package}.{kernel}", name)
        if cpu:
            CPU_FORMS[name] = (f"{package}.{cpu}", name)
        if gluon:
            GLUON_KERNELS[name] = (f"{package}.{gluon}", name)

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
    # The kernels are forward-only: under autograd a kernel would return a result with no gradient path,
    # silently freezing everything upstream of it. Recorded calls therefore run the reference.
    recording = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)
    device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)  # an op's tensors share one
    on_gpu = device is not None and device.type == "cuda"
    if backend in ("gluon", "auto") and op in GLUON_KERNELS and on_gpu and not recording and gluon_runs(op, device.index):
        return load_kernel(op, "gluon")
    if backend == "gluon":
        if explicit:
            raise ValueError(gluon_refusal(op, device, recording))
        backend = "triton"  # a model-wide "gluon": the Triton kernels where no sm_90 form runs
    registered = op in TRITON_KERNELS
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
    if registered and on_gpu and not recording and triton_available():
        return load_kernel(op)
    if op in CPU_FORMS and not on_gpu:  # plain PyTorch, differentiable like the reference
        module, name = CPU_FORMS[op]
        return getattr(importlib.import_module(module), name)
    return reference


def gluon_refusal(op: str, device: torch.device | None, recording: bool) -> str:
    """Why ``backend="gluon"`` cannot run this call of ``op``, and what to use instead."""
    if op not in GLUON_KERNELS:
        return f"{op} has no sm_90 (Gluon) form; use backend='triton' or 'auto'"
    if recording:
        return (f"the Gluon kernels of {op} have no backward, but its inputs require grad; use backend='torch' or "
                f"'auto' to train through them, or run under torch.no_grad()")
    return (f"backend='gluon' for {op} needs a capability-9.0 GPU (H100, H200) and a triton with Gluon; its "
            f"tensors are on {device}; use backend='triton' or 'auto'")
