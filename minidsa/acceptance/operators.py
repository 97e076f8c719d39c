"""Rung 2, single operators: every op the model calls, on the checkpoint's own shapes, as the chosen
backend runs it, against its PyTorch reference in fp64.

The inputs are the real ones: a cached prefill, one decode step and one forward without a cache run on
the torch backend while every op call's arguments are copied (``record_op_calls``). Each recorded call
is then run twice: by the implementation the chosen backend picks for that op (the Triton kernel where
one is registered, else the reference in the model's precision) and by the reference on fp64 copies of
the floating-point inputs. The reference is taken from ``ops.REFERENCES``, the table built at import,
so an implementation swapped out later (a patched function, a kernel) is compared with the original.

How outputs are compared:
- floating outputs: the largest difference relative to the reference's largest magnitude; infinities
  (scores of masked positions) must sit at the same places;
- FP8 and integer outputs of a copy or a conversion: bit for bit;
- top-k indices: the scores of the selected keys, sorted, must equal the reference's selection's to the
  tolerance; which of two tied keys was taken does not count.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch

from .. import ops
from ..model.minidsa import MiniDSA
from ..ops._dispatch import pick
from .report import Tolerance

CALLS_PER_OP = 2  # recorded calls per op: the first of each distinct shape signature (prefill, decode, ...)
EXACT_DTYPES = (torch.float8_e4m3fn, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(t) for t in x)
    return x


def _signature(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)


@contextlib.contextmanager
def record_op_calls(calls: list) -> Iterator[None]:
    """Append (op, copied args) for the first CALLS_PER_OP distinct shape signatures of every op the
    model calls through its reference (run the model on the torch backend inside)."""
    seen: dict[str, set] = {}
    originals = {op: spec.reference for op, spec in ops.OPS.items()}

    def spy(op, fn):
        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)  # as positional arguments, defaults filled in
            bound.apply_defaults()
            args = bound.args
            sig = _signature(args)
            kept = seen.setdefault(op, set())
            if sig not in kept and len(kept) < CALLS_PER_OP:
                kept.add(sig)
                calls.append((op, _clone(args)))
            return fn(*args)
        return call

    for op, fn in originals.items():  # the public ops read their reference from the registration at each call
        ops.OPS[op].reference = spy(op, fn)
    try:
        yield
    finally:
        for op, fn in originals.items():
            ops.OPS[op].reference = fn


def model_op_calls(model: MiniDSA, prompt_len: int, seed: int = 0) -> list:
    """The op calls of a cached prefill of ``prompt_len`` tokens, one decode step and an uncached forward."""
    calls: list = []
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len + 1), generator=gen).to(model.device)
    cache = model.new_cache(num_blocks=-(-(prompt_len + 1) // model.config.kv_block_size) + 1)
    sid = cache.add_sequence()
    backend = model.backend
    model.set_backend("torch")
    try:
        with torch.inference_mode(), record_op_calls(calls):
            model(ids[:, :prompt_len], cache=cache, seq_ids=[sid])
            model(ids[:, prompt_len:], cache=cache, seq_ids=[sid])
            model(ids[:, : min(prompt_len, 9)])
    finally:
        model.set_backend(backend)
    return calls


def _fp64(args, mutated: set[int]):
    """Floating inputs as fp64 (FP8 stays: it is a storage format the reference decodes); outputs as given."""
    return tuple(a.double() if isinstance(a, torch.Tensor) and i not in mutated and a.is_floating_point()
                 and a.dtype != torch.float8_e4m3fn else a for i, a in enumerate(args))


def _outputs(op: str, args, result) -> list[torch.Tensor]:
    """The returned tensors, then the arguments the op writes in place."""
    out = list(result) if isinstance(result, (tuple, list)) else ([] if result is None else [result])
    return out + [args[i] for i in _mutated(op)]


def _mutated(op: str) -> set[int]:
    names = torch._C.parse_schema(f"x::{op}{ops.OPS[op].schema}").arguments if op in ops.OPS else []
    return {i for i, a in enumerate(names) if a.alias_info is not None and a.alias_info.is_write}


def check_call(op: str, args, backend: str) -> tuple[float, str]:
    """(difference, implementation name) of one recorded call: the backend's implementation against the
    fp64 reference. The difference is relative (see the module doc); 0 for bit-equal copies."""
    mutated = _mutated(op)
    cand_args, ref_args = _clone(args), _fp64(_clone(args), mutated)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    with ops.use_backend(backend):
        impl = pick(op, None, ops.OPS[op].reference, *tensors)
    with torch.inference_mode():
        got = _outputs(op, cand_args, impl(*cand_args))
        want = _outputs(op, ref_args, ops.REFERENCES[op](*ref_args))
    if op == "topk_indices":
        return _topk_difference(got[0], want[0], ref_args[0]), impl.__module__
    return max(_difference(g, w) for g, w in zip(got, want)), impl.__module__


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if got.dtype in EXACT_DTYPES or want.dtype in EXACT_DTYPES:
        same = torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.to(got.dtype).view(torch.uint8) if got.dtype == torch.float8_e4m3fn
                           else want.to(got.dtype))
        return 0.0 if same else float("inf")
    g, w = got.double(), want.double()
    finite = torch.isfinite(w)
    if not torch.equal(finite, torch.isfinite(g)) or not torch.equal(g[~finite], w[~finite]):
        return float("inf")  # a masked position scored, or a real one masked
    if not finite.any():
        return 0.0
    scale = w[finite].abs().max().clamp_min(1e-30)
    return ((g[finite] - w[finite]).abs().max() / scale).item()


def _topk_difference(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> float:
    """Sorted scores of the selected keys against the reference selection's; -1 padding must agree."""
    if got.shape != want.shape or not torch.equal(got < 0, want < 0):
        return float("inf")

    def picked(idx):
        vals = scores.gather(-1, idx.long().clamp_min(0)).masked_fill(idx < 0, 0.0)
        return vals.sort(dim=-1, descending=True).values
    a, b = picked(got), picked(want)
    scale = scores[torch.isfinite(scores)].abs().max().clamp_min(1e-30) if torch.isfinite(scores).any() else 1.0
    return ((a - b).abs().max() / scale).item() if a.numel() else 0.0


def op_tolerance(dtype: torch.dtype) -> Tolerance:
    if dtype == torch.float32 or dtype == torch.float64:
        return Tolerance(1e-4, "fp32 inputs and fp32 accumulation against fp64: rounding of sums of up to a few "
                               "thousand terms and of exp stays near 1e-6 of the output scale; 1e-4 leaves margin "
                               "for the kernels' other summation order, and any wrong index or mask costs O(1)")
    return Tolerance(2e-2, f"{dtype} operands: one rounding of an output or an intermediate is up to 2^-8 = 3.9e-3 "
                           f"of its value, and a kernel rounds a few (P before P.V, the output); about five such "
                           f"roundings, while any wrong index or mask costs O(1)")


def check_operators(model: MiniDSA, backend: str, prompt_len: int) -> tuple[float, list[str], list[str], Tolerance]:
    """(worst difference, detail lines, failing ops, tolerance) over every recorded op call."""
    tol = op_tolerance(model.config.torch_dtype)
    worst, lines, bad = 0.0, [], []
    for op, args in model_op_calls(model, prompt_len):
        diff, impl = check_call(op, args, backend)
        shapes = " ".join("x".join(map(str, a.shape)) for a in args if isinstance(a, torch.Tensor))[:70]
        ok = diff <= tol.value
        lines.append(f"{'ok  ' if ok else 'FAIL'} {op:<19} {impl.rsplit('.', 1)[-1]:<16} {diff:9.2e}  [{shapes}]")
        worst = max(worst, diff)
        if not ok:
            bad.append(op)
    return worst, lines, bad, tol
