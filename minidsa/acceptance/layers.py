"""Rungs 3 and 4: the cached paths against the full forward, one layer at a time, then a whole request.

A full forward (no cache) is the reference: every position is computed at once by the plain path. The
cached paths split the same tokens into a prefill and one-token decode steps and take other routes
(paged keys, MLA absorbed into the latent space at decode, KDA's recurrent form instead of the chunked
one, the routed experts straight from MXFP4 instead of through the FP8 workspace). They must agree to
rounding.

Rung 3 feeds each layer type's first layer (MLA, KDA, MoE, dense MLP) the hidden states it receives in a
full forward of the model, so a layer is judged on its own. Rung 4 runs a greedy request: prefill, then
decode, timed apart, and compares every step's logits with one full forward over the same tokens.

In low precision a near-tie between two keys or two experts flips one way in one path and the other
way in the other; the doctor then holds the choices fixed (held.py) and says so.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .. import ops
from ..model.minidsa import MiniDSA
from .held import HeldChoices
from .report import Tolerance


def logits_tolerance(dtype: torch.dtype) -> Tolerance:
    if dtype in (torch.float32, torch.float64):
        return Tolerance(1e-4, "fp32 on both paths, in another order (absorbed against decompressed MLA, recurrent "
                               "against chunked KDA): about 1e-6 of the output scale after a few layers; a wrong "
                               "cache row or state moves it by O(1)")
    return Tolerance(5e-2, f"{dtype} activations between the layers: each rounding is up to 2^-8 of a value, and "
                           f"the two paths round at different places in every layer; a wrong cache row or state "
                           f"moves the output by O(1)")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def first_layers(model: MiniDSA) -> dict[str, torch.nn.Module]:
    """One module per layer type: the first MLA and KDA attention, the first MoE and dense MLP."""
    found: dict[str, torch.nn.Module] = {}
    for layer in model.language_model.model.layers:
        found.setdefault(layer.layer_type, layer.self_attn)
        found.setdefault("moe" if layer.is_moe else "mlp", layer.block_sparse_moe if layer.is_moe else layer.mlp)
    return found


def _pieces(prompt_len: int, steps: int) -> list[tuple[int, int]]:
    return [(0, prompt_len)] + [(prompt_len + i, prompt_len + i + 1) for i in range(steps)]


def _layer_inputs(model: MiniDSA, modules: dict, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input each module receives in a full forward of ``ids``."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, args, k=k: seen.setdefault(k, args[0].clone()))
             for k, m in modules.items()]
    try:
        with torch.inference_mode():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _cached_layer(model: MiniDSA, module, x: torch.Tensor, pieces, attention: bool, trace=None) -> torch.Tensor:
    """``module`` over ``x`` piece by piece, an attention layer through a fresh cache of its own; ``trace()``
    (when given) makes each call's ForwardTrace."""
    cache = model.new_cache(num_blocks=-(-x.shape[1] // model.config.kv_block_size) + 1) if attention else None
    sid = cache.add_sequence() if attention else None
    outs = []
    for a, b in pieces:
        kw = {} if trace is None else {"trace": trace()}
        if not attention:
            outs.append(module(x[:, a:b], **kw))
            continue
        ctx = cache.prepare([sid], b - a, x.device, max_len=model.config.max_seq_len, rows=1)
        outs.append(module(x[:, a:b], ctx, **kw))
        ctx.publish()
    return torch.cat(outs, dim=1)


def check_layers(model: MiniDSA, prompt_len: int, steps: int, hold: bool) -> tuple[float, list[str], list[str]]:
    """(worst relative difference, a line per layer type, failing types)."""
    tol = logits_tolerance(model.config.torch_dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len + steps), generator=gen).to(model.device)
    modules = first_layers(model)
    inputs = _layer_inputs(model, modules, ids)
    worst, lines, bad = 0.0, [], []
    for kind, module in modules.items():
        held = HeldChoices()
        attention = kind in ("mla", "kda")
        with torch.inference_mode(), ops.use_backend(model.backend):
            # a dense MLP chooses nothing: it takes no trace
            trace = (lambda: held.trace() if hold else None) if kind != "mlp" else None
            with held.recording() if hold else contextlib.nullcontext():
                full = module(inputs[kind]) if trace is None else module(inputs[kind], trace=trace())
            with held.replaying() if hold else contextlib.nullcontext():
                cached = _cached_layer(model, module, inputs[kind], _pieces(prompt_len, steps), attention, trace)
        diff = _relative(cached, full)
        worst = max(worst, diff)
        ok = diff <= tol.value
        bad += [] if ok else [kind]
        what = "prefill + decode through the cache" if attention else "prefill rows, then one token at a time"
        lines.append(f"{'ok  ' if ok else 'FAIL'} {kind:<4} layer {_index(model, module)}: {what} against the full "
                     f"forward, {diff:.2e}")
    return worst, lines, bad


def _index(model: MiniDSA, module) -> int:
    return next(i for i, layer in enumerate(model.language_model.model.layers) if module in layer.children())


def _sync(model: MiniDSA) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _cached_request(model: MiniDSA, prompt: torch.Tensor, steps: int, forced: list[int] | None,
                    held: HeldChoices | None = None):
    """(logits [steps, V] of each step, tokens, prefill s, decode s per token): greedy, or teacher-forced;
    with ``held``, every forward hands its choices to it."""
    cache = model.new_cache(num_blocks=-(-(prompt.shape[1] + steps) // model.config.kv_block_size) + 1)
    sid = cache.add_sequence()
    _sync(model)
    t0 = time.perf_counter()
    def trace():
        return None if held is None else held.trace()
    logits = [model(prompt, cache=cache, seq_ids=[sid], trace=trace())[0, -1]]
    _sync(model)
    t1 = time.perf_counter()
    tokens = []
    for i in range(steps):
        tokens.append(int(logits[-1].argmax()) if forced is None else forced[i])
        if i + 1 < steps:
            nxt = torch.tensor([[tokens[-1]]], device=model.device)
            logits.append(model(nxt, cache=cache, seq_ids=[sid], trace=trace())[0, -1])
    _sync(model)
    t2 = time.perf_counter()
    return torch.stack(logits), tokens, t1 - t0, (t2 - t1) / max(1, steps - 1)


def check_request(model: MiniDSA, prompt_len: int, steps: int, hold: bool) -> dict:
    """Greedy prefill + decode against one full forward over the same tokens: the relative logit difference,
    at how many steps the full forward's argmax is another token and the largest logit gap there (relative to
    the logit scale: a near-tie when within the tolerance), and the two timings."""
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=gen).to(model.device)
    with torch.inference_mode():
        cached, tokens, prefill_s, decode_s = _cached_request(model, prompt, steps, None)
        whole = torch.cat([prompt, torch.tensor([tokens[:-1]], device=model.device, dtype=prompt.dtype)], dim=1)
        held = HeldChoices()
        with held.recording() if hold else contextlib.nullcontext():
            full = model(whole, trace=held.trace() if hold else None)[0, prompt_len - 1:]
        if hold:  # the same tokens again, now on the full forward's choices
            with held.replaying():
                cached = _cached_request(model, prompt, steps, tokens, held)[0]
    # where the full forward's argmax is another token, how far apart the two tokens' logits are (0: same)
    picked = full.gather(-1, cached.argmax(-1, keepdim=True))[:, 0]  # the cached run's greedy picks
    gaps = ((full.max(-1).values - picked) / full.abs().max()).tolist()
    return {"diff": _relative(cached, full), "max_gap": max(gaps), "partings": sum(g > 0 for g in gaps),
            "prefill_ms": prefill_s * 1e3, "decode_ms": decode_s * 1e3, "tokens": tokens}
