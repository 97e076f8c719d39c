"""Which form the sparse MLA prefill runs (prefill_triton.py): the union form or the absorbed form, per call.

The union form (prefill_union_triton.py, prefill_attn_triton.py) costs per selected pair (the bit marks and the
decompression) plus per (query, union slot) pair of its query tiles, times the heads: one program per head and
tile. The absorbed form (latent_triton.sparse_mla_prefill_absorbed: W_UK folded into q, the latent kernel over
each query's own rows, W_UV after; 3.4x the FLOPs per pair at the K3 dims, but one gathered latent row serves
all heads) costs per selected pair, and its gathers bind it; its programs hold up to 64 heads. So the union form
pays while a tile's union stays a small multiple of top-k, the more so the fewer the heads.

The op builds the unions first (cheap, and the union form reuses them), then compares their exact pair count
with the selected pairs: ``use_union_form`` against ``union_break_even(heads, gluon)``, the ratio at which the
cost model below makes both forms equal. A call that ends in the absorbed form has paid for the bits, the
unions and the decompression (about 5 % of that form's time at T = 32k).

``FORM`` (environment MINIDSA_PREFILL_FORM, default "auto"): "union" / "absorbed" force one form (tests,
benchmarks); any other value raises at the first decision. Pure Python: nothing here launches a kernel.

The union form's choice waits for the unions' counts (a host synchronisation), which a CUDA graph cannot
capture. Inside ``sync_free()`` (the step graphs' warm-ups and captures, serving/step_graphs.py) the form is
chosen from nothing but the call's shapes: the union form where the block table reaches no further than top-k
(a tile's union is then at most top-k positions, and its buffers are sized from the shapes), else the absorbed
form, which needs no count.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch

# Which form runs: "auto" picks per call (use_union_form); "union" / "absorbed" force one (tests, benchmarks).
FORM = os.environ.get("MINIDSA_PREFILL_FORM", "auto")
# The two forms' costs in seconds, fitted on the H200 (T=32,768, top-k 2048, K3 dims, bf16, 128-query tiles;
# each form forced, four selection patterns at 16, 32, 64 and 96 heads). Union form: per selected pair
# 1.08e-11 + 4.4e-13 per head (bits, unions, decompression), plus 1.6e-12 per head and (query, union slot) pair.
# Absorbed form: per selected pair, which its gathers bind: 2.65e-10 up to 16 heads (the Triton kernel's 16-row
# tiles), else 3.45e-10 per 64 heads (the Gluon kernel's tiles on sm_90). The fit and its residuals:
# docs/benchmarks.md, "Prefill: form cost model".
UNION_FIXED = (1.08e-11, 4.4e-13)
UNION_PER_HEAD_PAIR = 1.6e-12
# The Gluon kernel's per (head, union pair) cost: the Triton kernel's scaled by their measured ratio (0.84-0.85,
# 16 heads; a program's work does not depend on the head count), not refitted.
UNION_PER_HEAD_PAIR_GLUON = 1.36e-12
ABSORBED_UP_TO_16_HEADS, ABSORBED_PER_64_HEADS = 2.65e-10, 3.45e-10


_SYNC_FREE = contextvars.ContextVar("minidsa_prefill_sync_free", default=False)


@contextlib.contextmanager
def sync_free():
    """Within: every sparse MLA prefill runs a form chosen without a host synchronisation (the module's text)."""
    token = _SYNC_FREE.set(True)
    try:
        yield
    finally:
        _SYNC_FREE.reset(token)


def must_not_sync() -> bool:
    """Whether the prefill must take a form chosen without the GPU's counts (``sync_free``, or a capture)."""
    return _SYNC_FREE.get() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def union_break_even(heads: int, gluon: bool = False) -> float:
    """(query, union slot) pairs per (query, selected position) pair below which the union form is faster
    (the cost model above): 9.7 at 16 heads, 6.2 at 32, 3.0 at 64, 4.1 at 96 with the Triton union kernel; 11.4,
    7.4, 3.5 and 4.9 with the Gluon kernel (``gluon``). Below 16 heads, unmeasured, it stays at the 16-head
    value rather than extrapolate the union form's per-head cost."""
    h = max(heads, 16)
    programs = -(-heads // 64)  # 64-head programs of the absorbed form
    absorbed = ABSORBED_UP_TO_16_HEADS if heads <= 16 else ABSORBED_PER_64_HEADS * programs
    per_pair = UNION_PER_HEAD_PAIR_GLUON if gluon else UNION_PER_HEAD_PAIR
    return (absorbed - UNION_FIXED[0] - UNION_FIXED[1] * h) / (per_pair * h)


def use_union_form(union_pairs: float, selected: int, heads: int = 16, gluon: bool = False) -> bool:
    """Whether the union form is expected to beat the absorbed form: FORM, or for "auto" the ratio of
    (query, union slot) pairs to (query, selected position) pairs against union_break_even(heads, gluon)."""
    if FORM not in ("auto", "union", "absorbed"):
        raise ValueError(f"prefill_form.FORM is {FORM!r}; use 'auto', 'union' or 'absorbed'")
    if FORM != "auto":
        return FORM == "union"
    return union_pairs < union_break_even(heads, gluon) * selected
