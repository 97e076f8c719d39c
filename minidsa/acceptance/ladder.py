"""``minidsa.doctor(...)``: walk the Day-0 acceptance ladder for one checkpoint, backend and device, and stop
at the first rung that fails.

    report = minidsa.doctor("default")                       # the shipped model on the CPU
    report = minidsa.doctor("small", backend="triton", device="cuda")
    print(report); report.ok; report.failed; report.to_json()

The rungs, each a gate with its tolerance and the reason for it (docs/design.md §19):
1. checkpoint: the validator, a full verified load, known answers where the checkpoint records them;
2. single operators: each op as the backend runs it against its fp64 reference, on the model's shapes;
3. single layers: each layer type's cached prefill + decode against its full forward;
4. single request: greedy prefill then decode against the full forward, prefill and decode timed;
5. batched requests: rows of a batch through the engine against the same prompts alone, and the engine's
   CUDA graph replays against eager steps on the same cache;
6. multimodal: an image request and a video request end to end;
7. the service: ``python -m minidsa serve`` started fresh on a free local port, a plain and a streamed
   request against the eager engine's text, /metrics.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch

from ..model.minidsa import MiniDSA
from ..ops._dispatch import check_backend
from . import checkpoint, end_to_end, layers, operators
from .report import DoctorReport, Gate

DECODE_STEPS = 4  # one-token steps after the prefill in rungs 3 and 4
NEAR_TIE = ("greedy tokens part only where the two best logits nearly tie; a parting passes when the two tokens' "
            "logits in a full forward are within {tol:g} of the logit scale (the logits tolerance)")


def prompt_len(model: MiniDSA) -> int:
    """Longer than twice the DSA top-k, so that selection really drops keys, and within the context."""
    cfg = model.config
    return max(16, min(2 * cfg.indexer.topk + 8, cfg.max_seq_len // 2))


def _check_interpreter(backend: str, device: str) -> None:
    """Triton on a CPU runs only in its interpreter, which triton reads once, when it is imported."""
    if backend != "triton" or device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise ValueError("backend='triton' on the CPU needs Triton's interpreter, but triton was imported without "
                         "TRITON_INTERPRET=1; set it before anything imports triton (the CLI does)")
    os.environ["TRITON_INTERPRET"] = "1"


def doctor(checkpoint_or_preset="default", *, backend: str = "auto", device: str = "cpu",
           hold_choices: bool | None = None) -> DoctorReport:
    """The ladder for ``checkpoint_or_preset`` (a directory, "default" or a preset name) on ``device`` with
    ``backend`` ("torch", "triton", "gluon" or "auto"); returns the report up to the first failing gate.
    ``hold_choices``: hold DSA keys and routed experts fixed in the comparisons (None: below fp32 only)."""
    check_backend(backend)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device = {device!r}; use 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu'")
    _check_interpreter(backend, device)
    gate, model = checkpoint.check(checkpoint_or_preset, device)
    report = DoctorReport(str(checkpoint_or_preset), backend, device, "not loaded", False, [gate])
    if model is None:
        return report
    model.set_backend(backend)
    dtype = model.config.torch_dtype
    report.dtype = str(dtype).replace("torch.", "")
    report.held_choices = dtype not in (torch.float32, torch.float64) if hold_choices is None else bool(hold_choices)
    service = functools.partial(_service, source=checkpoint_or_preset, backend=backend, device=device)
    for rung in (_operators, _layers, _request, _batch, _media, service):
        t0 = time.perf_counter()
        gate = rung(model, report.held_choices)
        gate.seconds = time.perf_counter() - t0
        report.gates.append(gate)
        if not gate.ok:
            break
    return report


def _operators(model: MiniDSA, hold: bool) -> Gate:
    worst, lines, bad, tol = operators.check_operators(model, model.backend, prompt_len(model))
    gate = Gate(2, "single operators", "FAIL" if bad else "PASS",
                f"{len(lines)} op calls against the fp64 reference, worst relative difference {worst:.1e}",
                f"{tol.value:g}", tol.why, details=lines)
    if bad:
        gate.look_at = (f"{', '.join(sorted(set(bad)))}: the implementation named on its line (minidsa/ops/<op>/), "
                        f"against ops.REFERENCES; --backend torch tells a kernel fault from a model fault")
    return gate


def _layers(model: MiniDSA, hold: bool) -> Gate:
    tol = layers.logits_tolerance(model.config.torch_dtype)
    worst, lines, bad = layers.check_layers(model, prompt_len(model), DECODE_STEPS, hold)
    gate = Gate(3, "single layers", "FAIL" if bad else "PASS",
                f"{len(lines)} layer types, cached prefill + {DECODE_STEPS} decode steps against the full forward, "
                f"worst relative difference {worst:.1e}", f"{tol.value:g}", tol.why, details=lines)
    if bad:
        gate.look_at = (f"the cached path of {', '.join(bad)} (model/mla.py _attend_decode / _attend_prefill, "
                        f"model/kda.py, model/moe.py _routed) and the paged ops it calls")
    return gate


def _request(model: MiniDSA, hold: bool) -> Gate:
    tol = layers.logits_tolerance(model.config.torch_dtype)
    n = prompt_len(model)
    r = layers.check_request(model, n, DECODE_STEPS * 2, hold)
    ok = r["diff"] <= tol.value and r["max_gap"] <= tol.value
    tokens = ("the same greedy tokens" if not r["partings"] else
              f"{r['partings']} greedy token(s) differ from the full forward's argmax, at a logit gap of "
              f"{r['max_gap']:.1e} of the scale ({'near-ties' if r['max_gap'] <= tol.value else 'not a tie'})")
    gate = Gate(4, "single request", "PASS" if ok else "FAIL",
                f"greedy {n}-token prefill + {DECODE_STEPS * 2} tokens against one full forward: logits "
                f"{r['diff']:.1e}, {tokens}; prefill {r['prefill_ms']:.1f} ms, decode {r['decode_ms']:.1f} ms/token",
                f"{tol.value:g}", tol.why)
    if not ok:
        gate.look_at = ("the cache context between steps (cache/paged.py prepare/publish: positions, slots, KDA "
                        "state slots) and the decoder's Block AttnRes wiring in cached forwards")
    return gate


def _token_gate(model: MiniDSA, hold: bool, rung: int, name: str, check, measured: str, look_at: str) -> Gate:
    """A rung judged by greedy tokens: equal, or parting only at a near-tie (rungs 5 and 6)."""
    tol = layers.logits_tolerance(model.config.torch_dtype).value
    ok, lines = check(model, tol, hold)
    return Gate(rung, name, "PASS" if ok else "FAIL", measured, "tokens equal, or parting at a near-tie",
                NEAR_TIE.format(tol=tol), look_at="" if ok else look_at, details=lines)


def _batch(model: MiniDSA, hold: bool) -> Gate:
    gate = _token_gate(model, hold, 5, "batched requests", end_to_end.check_batch,
                       f"4 prompts as one engine batch against each alone, {end_to_end.MAX_TOKENS} greedy tokens; "
                       f"the decode steps as CUDA graph replays against eager steps",
                       "rows that see each other: padding rows (position -1, slot -1, block table -1), the block "
                       "tables and KDA state slots of a batch (serving/scheduler.py, cache/paged.py)")
    tol = layers.logits_tolerance(model.config.torch_dtype).value
    ok, lines = end_to_end.check_graphs(model, tol)
    gate.details += lines
    if not ok:
        gate.status = "FAIL"
        gate.look_at = ("a replayed step that differs from the eager one: what the capture recorded "
                        "(serving/cuda_graphs.py: static buffers, weights that moved since, lazily built state)")
    return gate


def _media(model: MiniDSA, hold: bool) -> Gate:
    return _token_gate(model, hold, 6, "multimodal", end_to_end.check_media,
                       "an image and a video request through the engine, each greedy token against the full forward",
                       "media tokens in cached prefill (serving/engine.py _inputs: inputs_embeds of media rows) and "
                       "the vision tower's preprocessing (model/vision.py)")


def _service(model: MiniDSA, hold: bool, source, backend: str, device: str) -> Gate:
    ok, lines = end_to_end.check_service(model, source, backend, device)
    gate = Gate(7, "the service", "PASS" if ok else "FAIL",
                "`serve` as a fresh process on a free 127.0.0.1 port: a plain and a streamed completion over HTTP "
                "equal an engine's text here, whose graphs give the eager steps' tokens (fp32 twin) or part at a "
                "near-tie; /metrics counts them", details=lines)
    if not ok:
        gate.look_at = ("what a fresh process does first (the engine captures its graphs before any forward: "
                        "serving/cuda_graphs.py), then minidsa/server/ (request parsing, the engine thread, "
                        "server-sent events, metrics)")
    return gate
