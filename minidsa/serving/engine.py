"""The serving engine: requests in, a scheduled step at a time, outputs out (docs/design.md §16).

    engine = minidsa.Engine(model, max_num_seqs=8, max_num_batched_tokens=512)
    outs = engine.generate(["a prompt", "another"], minidsa.SamplingParams(temperature=0, max_tokens=32))
    rid = engine.add_request("hi", params); while engine.has_unfinished_requests(): engine.step()

One step: the scheduler picks requests and token counts under the budget (scheduler.py), the model
runner (runner.py) runs them as one forward over packed tokens (decode rows first, then each prefill
piece) and chooses the next token where a request reached its end, and the engine hands back a
RequestOutput for every request that moved. A prefill piece also ends where a KDA checkpoint is due
(prefix_cache.py), so that the state there can be copied: a request whose scheduled tokens cross a
checkpoint runs its second piece in a second forward of the same step (rare: only long prompts).

A request that fails (its forward raises, or its logits hold NaN or inf where a token is due) finishes
with finish_reason "error", its ``error`` saying why, and gives back what it held; the others go on.
Every argument is checked in ``add_request`` before anything is queued. One thread drives an engine
(``add_request``, ``step`` and ``abort`` are not meant to race); several engines may share one model
and, through generate(), one cache, whose books are locked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import os
import time

import torch
from tqdm.auto import tqdm

from ..cache import PagedKVCache
from ..model.minidsa import MiniDSA
from ..model.trace import ForwardTrace
from .budget import plan_cache
from .params import RequestMetrics, RequestOutput, SamplingParams
from .prefix_cache import PrefixCache, block_hashes
from .requests import Prompt, RequestError, check_context, check_positive_int, media_features, prepare_prompts
from .runner import ModelRunner
from .scheduler import EngineRequest, Scheduler

# Default tokens between KDA checkpoints, at most. A checkpoint costs no forward (the step keeps the state as it
# runs) but one pool entry of every KDA layer's state, so a shorter interval spends the pool faster; a shared
# prefix shorter than the interval gets no state hit. A model whose context is short gets a quarter of it
# instead (CHECKPOINTS_PER_CONTEXT): at 256 tokens the shipped model (max_seq_len 256) could never reach a
# checkpoint, so prefix caching gave it no state hit at all.
CHECKPOINT_TOKENS = 256
CHECKPOINTS_PER_CONTEXT = 4


class NonFiniteLogitsError(RuntimeError):
    """A request's logits held NaN or inf where a token was to be sampled (a model or kernel fault)."""


class Engine:
    """Continuous batching over one model and one paged cache, with prefix caching and chunked prefill."""

    def __init__(self, model: MiniDSA, *, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 num_blocks: int | None = None, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, cuda_graphs: str = "auto", compile_decode: bool = False,
                 max_checkpoints: int | None = None,
                 checkpoint_interval: int | None = None, memory_bytes: int | None = None, cache=None,
                 raise_errors: bool = False, held_choices=None) -> None:
        if not isinstance(model, MiniDSA):
            raise TypeError(f"model must be a MiniDSA (minidsa.load(...)), got {type(model).__name__}")
        cfg = model.config
        self.model, self.held_choices = model, held_choices  # held: an acceptance.HeldChoices (model/trace.py)
        self.max_num_seqs = cfg.max_sequences if max_num_seqs is None else max_num_seqs
        self.max_num_batched_tokens = (max(cfg.max_seq_len, 512) if max_num_batched_tokens is None
                                       else max_num_batched_tokens)
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        self.align = math.lcm(cfg.kv_block_size, cfg.kda.chunk_size)
        self.checkpoint_interval = self._interval(checkpoint_interval)
        self._check_budget(enable_chunked_prefill)
        if cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs = {cuda_graphs!r}; use 'auto' (on a CUDA device), 'on' or 'off'")
        if cuda_graphs == "on" and model.device.type != "cuda":
            raise ValueError(f"cuda_graphs='on' needs a model on a CUDA device, this one is on {model.device}; "
                             f"use 'auto' or 'off'")
        if compile_decode and (cuda_graphs == "off" or model.device.type != "cuda"):
            raise ValueError(f"compile_decode=True compiles the captured decode graphs, which need a CUDA device and "
                             f"cuda_graphs 'auto' or 'on' (model on {model.device}, cuda_graphs={cuda_graphs!r})")
        self.max_checkpoints = 2 * self.max_num_seqs if max_checkpoints is None else max_checkpoints
        self.budget = plan_cache(model, self.max_num_seqs, self.max_num_batched_tokens,
                                 self.max_checkpoints if enable_prefix_caching else 0, num_blocks, memory_bytes)
        if cache is None:  # one KDA state slot per sequence the engine may run
            layout = model.cache_layout(self.budget["num_blocks"])
            cache = PagedKVCache(dataclasses.replace(layout, num_state_slots=self.max_num_seqs), model.device)
        model.check_cache(cache)
        self.cache = cache
        self.prefix = PrefixCache(cache, self.max_checkpoints) if enable_prefix_caching else None
        self.scheduler = Scheduler(cache, self.prefix, min(self.max_num_seqs, cache.layout.num_state_slots),
                                   self.max_num_batched_tokens, enable_chunked_prefill, self.align)
        self.runner = ModelRunner(model, cache, self.scheduler.max_num_seqs,
                                  cuda_graphs != "off" and model.device.type == "cuda", compile_decode)
        if self.runner.graphs is not None:  # a GPU engine: compile the prefill path before the first request
            self.runner.warm_up(self.max_num_batched_tokens)
        self.requests: dict[str, EngineRequest] = {}
        self.listeners: list = []  # see add_listener
        # A library call (generate()) wants a failed forward as its own exception; a service fails the step's
        # requests and goes on with the others.
        self.raise_errors = bool(raise_errors)
        self._ids = itertools.count()
        self.prompt_tokens = self.generation_tokens = 0
        self.decode_steps, self.decode_tokens, self.decode_seconds = 0, 0, 0.0  # steps whose rows were all decodes
        self.prefill_steps, self.prefill_seconds = 0, 0.0  # steps with prefill rows

    @property
    def graphs(self):
        """The runner's captured decode steps (DecodeGraphs), or None where steps run eagerly."""
        return self.runner.graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self.runner.graphs = graphs

    def _interval(self, interval: int | None) -> int:
        if interval is None:  # CHECKPOINT_TOKENS, or a quarter of a short context, down to a multiple of the alignment
            want = min(CHECKPOINT_TOKENS, self.model.config.max_seq_len // CHECKPOINTS_PER_CONTEXT)
            return max(self.align, want // self.align * self.align)
        check_positive_int("checkpoint_interval", interval)
        if interval % self.align:
            raise ValueError(f"checkpoint_interval = {interval} must be a multiple of {self.align} (a KV block and "
                             f"a KDA chunk both end there); e.g. {self.align * max(1, round(interval / self.align))}")
        return interval

    def _check_budget(self, chunked: bool) -> None:
        ctx = self.model.config.max_seq_len
        if not chunked and self.max_num_batched_tokens < ctx:
            raise ValueError(f"max_num_batched_tokens = {self.max_num_batched_tokens} is below max_seq_len = {ctx}: "
                             f"without chunked prefill a prompt must fit one step; raise it or enable chunked prefill")
        if self.max_num_batched_tokens < self.align:
            raise ValueError(f"max_num_batched_tokens = {self.max_num_batched_tokens} must be >= {self.align} "
                             f"(one KV block and KDA chunk), so a prefill chunk can make progress")

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: str, params: SamplingParams | None = None, images=None,
                    request_id: str | None = None) -> str:
        """Check and queue one request; returns its id. Raises before anything is queued; an error about the
        prompt, its images or ``max_tokens`` names the argument as its ``field``."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        params = self._check_args(params, request_id)  # before any image is decoded
        try:
            prepared = prepare_prompts(self.model, [prompt], images, False)[0]
        except (ValueError, TypeError) as e:  # the prompt's placeholders or an image: named for a service
            e.field = getattr(e, "field", "images" if images else "prompt")
            raise
        return self._add_prepared(prepared, params, request_id)

    def add_prompt(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """``add_request`` for a prompt already encoded (``serving.requests.prepare_prompts``): a service that
        checked its length queues it as it is; its images go through the vision tower here."""
        return self._add_prepared(prompt, self._check_args(params, request_id), request_id)

    def _add_prepared(self, prompt: Prompt, params: SamplingParams, request_id: str | None) -> str:
        self._check_fits(len(prompt.ids), params.max_tokens)
        return self.enqueue(prompt.text, prompt.ids, media_features(self.model, prompt), params, request_id).request_id

    def _check_args(self, params, request_id) -> SamplingParams:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a minidsa.SamplingParams, got {type(params).__name__}")
        if request_id is not None and (not isinstance(request_id, str) or request_id in self.requests):
            raise ValueError(f"request_id {request_id!r} is already in use (or not a str); pass a new one or None")
        return params

    def enqueue(self, prompt: str | None, ids: list[int], features: list, params: SamplingParams,
                request_id: str | None = None, trace=None) -> EngineRequest:
        """Queue an encoded, checked request (``add_request`` is the checked entry; ``generate()`` comes
        here with its own checks). ``trace``: a GenerationTrace to fill with the request's selections."""
        rid = str(next(self._ids)) if request_id is None else request_id
        while rid in self.requests:
            rid = str(next(self._ids))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(6), "little")
        hashes = [] if self.prefix is None else block_hashes(  # names are for the prefix cache only
            ids, _media_keys(ids, features, self.model.tokenizer.media_pad_id), self.cache.block_size)
        req = EngineRequest(rid, prompt, list(ids), features, hashes, params, torch.Generator().manual_seed(seed),
                            self.model.tokenizer.stream_decoder(),
                            RequestMetrics(time.perf_counter(), num_prompt_tokens=len(ids)), trace=trace)
        self.requests[rid] = req
        self.scheduler.waiting.append(req)
        for listener in self.listeners:  # the seed as drawn: a mirror samples exactly as this engine does
            listener.queued(prompt, ids, features, dataclasses.replace(params, seed=seed), rid)
        return req

    def admit_all(self, requests: list[EngineRequest]) -> None:
        """Start these queued requests now, all or nothing, each with room for its prompt and ``max_tokens``
        reserved, so none is ever preempted (``generate()``'s batch). Where other calls on a shared cache hold
        the room, waits until they give it back; OutOfKVBlocksError, nothing kept, where waiting cannot help."""
        self.scheduler.admit_all(requests, [len(r.prompt_ids) + r.params.max_tokens for r in requests])

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        check_context("the prompt", prompt_len, "max_tokens", max_tokens, self.model.config.max_seq_len)
        need = -(-(prompt_len + max_tokens) // self.cache.block_size)
        if need > self.cache.layout.num_blocks:
            raise RequestError(f"the prompt and max_tokens need {need} KV blocks but the cache has "
                               f"{self.cache.layout.num_blocks}: it can never fit; lower max_tokens or raise num_blocks",
                               "max_tokens")

    def abort(self, request_id: str) -> None:
        """Stop a request now and give back everything it holds (ValueError for an unknown id)."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request id {request_id!r}; live requests: {sorted(self.requests)}")
        self._finish(req, "abort")
        del self.requests[request_id]
        for listener in self.listeners:
            listener.aborted(request_id)

    def add_listener(self, listener) -> None:
        """Call ``listener.queued(prompt, ids, features, params, request_id)`` after each queued request (params
        with the seed it samples with), ``listener.aborted(request_id)`` after each abort and
        ``listener.stepping()`` before each step: every call that changes what this engine runs, in order, so
        that another engine can mirror it (distributed/follow.py)."""
        self.listeners.append(listener)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ---------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; the outputs of every request that moved."""
        for listener in self.listeners:
            listener.stepping()
        now = time.perf_counter()
        work = self.scheduler.schedule()
        decode_only = bool(work) and all(n == 1 and req.num_computed >= len(req.prompt_ids) for req, n in work)
        for req, _ in work:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        pieces = sorted(((req, req.num_computed, req.num_computed + n) for req, n in work),
                        key=lambda p: p[2] - p[1] > 1)  # stable: decode rows first, then schedule order
        moved = {req.request_id: req for req in (self._run(pieces) if pieces else ())}
        outs = [self._output(r) for r in moved.values()]
        for r in moved.values():
            if r.finished:
                self.requests.pop(r.request_id, None)
        if decode_only:
            self.decode_steps += 1
            self.decode_tokens += len(work)
            self.decode_seconds += time.perf_counter() - now
        elif work:
            self.prefill_steps += 1
            self.prefill_seconds += time.perf_counter() - now
        return outs

    def _checkpoints(self, pieces: list[tuple[EngineRequest, int, int]]) -> list[tuple[int, int]]:
        """(piece, tokens into it) of every KDA checkpoint strictly inside a piece, within its prompt: the step
        keeps those states as it runs (a checkpoint at a piece's end is the state it leaves in its slot)."""
        if self.prefix is None or not self.prefix.has_state:
            return []
        k, chunk = self.checkpoint_interval, self.model.config.kda.chunk_size
        # A piece starts on a multiple of ``align`` (the scheduler cuts there, hits end on checkpoints), so each
        # offset is a multiple of the KDA chunk, where the chunk form has the state; the test only guards that.
        return [(i, c - a) for i, (req, a, b) in enumerate(pieces)
                for c in range((a // k + 1) * k, min(b - 1, len(req.prompt_ids)) + 1, k) if (c - a) % chunk == 0]

    def _run(self, group: list[tuple[EngineRequest, int, int]]) -> list[EngineRequest]:
        """One packed forward of tokens [start, end) of each request; sample where a piece reached its end."""
        reqs = [g[0] for g in group]
        held = self.held_choices
        tr = ForwardTrace(held=held) if held is not None or any(r.trace is not None for r in reqs) else None
        ends = [row for row, (req, _, end) in enumerate(group) if end == req.num_tokens and not req.pending_finish]
        keep = self._checkpoints(group)
        try:
            with torch.inference_mode():
                last, kept = self.runner.execute(group, ends, tr, keep)  # logits [len(ends), V] on the host
        except Exception as e:  # noqa: BLE001 -- the request fails, the engine and the others go on
            for req in reqs:
                req.error = f"{type(e).__name__}: {e}"
                self._finish(req, "error")
            if self.raise_errors:
                raise
            return reqs
        if keep:  # named by the blocks they end; before the checkpoints at the pieces' ends, deeper, kept longer
            bs = self.cache.block_size
            self.prefix.insert_kept([group[i][0].hashes[(group[i][1] + t) // bs - 1] for i, t in keep], kept)
        at = 0
        for req, start, end in group:
            req.num_computed = end
            self.prompt_tokens += max(0, min(end, len(req.prompt_ids)) - start)
            self._remember(req, end)
            if req.trace is not None:
                req.trace.append_span(tr, at, at + end - start)
            at += end - start
        # Checked on that copy, over the real vocabulary only (_sample masks the padding ids to -inf): a NaN
        # would otherwise be sampled as token 0 (greedy) or fail inside torch.multinomial.
        real = last[:, :self.model.tokenizer.vocab_size]
        bad = (~torch.isfinite(real)).sum(1).tolist() if ends else []
        greedy = real.argmax(1).tolist() if ends else []  # every row's argmax in one call (the first of ties)
        for req in reqs:
            if req.pending_finish:  # its last token was fed only to record that token's selections
                self._finish(req, req.pending_finish)
        failed = []
        for k, row in enumerate(ends):
            if bad[k]:
                failed.append(self._fail_non_finite(group[row][0], bad[k]))
            else:
                self._sample(group[row][0], last[k], greedy[k])
        if failed and self.raise_errors:
            raise NonFiniteLogitsError(failed[0])
        return reqs

    def _fail_non_finite(self, req: EngineRequest, count: int) -> str:
        """Finish ``req`` with "error": its logits hold ``count`` NaN/inf values. Returns the message."""
        m = self.model
        req.error = (f"the logits of this request's last position hold NaN or inf ({count} of "
                     f"{m.tokenizer.vocab_size} values); the model or a kernel produced non-finite values, so no "
                     f"token was sampled: run `python -m minidsa doctor --checkpoint <this model's checkpoint> "
                     f"--backend {m.backend or 'auto'} --device {m.device.type}` to find the first op that fails")
        if self.prefix is not None:
            self.prefix.forget(req.sid)
        self._finish(req, "error")
        return req.error

    def _remember(self, req: EngineRequest, end: int) -> None:
        """Name the prompt's newly full blocks; copy the KDA state where a checkpoint is due."""
        if self.prefix is None:
            return
        bs = self.cache.block_size
        full = min(end, len(req.prompt_ids)) // bs
        self.prefix.insert_blocks(req.sid, req.hashes, full)
        if end % self.checkpoint_interval == 0 and end <= len(req.prompt_ids):  # so block end // bs is named
            self.prefix.insert_checkpoint(req.hashes[end // bs - 1], req.sid)

    def _sample(self, req: EngineRequest, logits: torch.Tensor, argmax: int) -> None:
        p, tok = req.params, self.model.tokenizer
        token = argmax if p.temperature == 0 else self.runner.sample(req, logits)
        now = time.perf_counter()
        req.output_ids.append(token)
        req.metrics.token_times.append(now)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        self.generation_tokens += 1
        reason = ("stop" if token == tok.eos_id and not p.ignore_eos else
                  "length" if len(req.output_ids) >= p.max_tokens else None)
        req.text += req.decoder.push(token) + (req.decoder.flush() if reason else "")
        stop_at = min((i for i in (req.text.find(s) for s in p.stop or ()) if i >= 0), default=-1)
        if stop_at >= 0:  # the stop string ends the text and is not part of it
            req.text, reason = req.text[:stop_at], "stop"
        if reason and req.trace is not None:
            req.pending_finish = reason  # one more step feeds the last token, for its selections
        elif reason:
            self._finish(req, reason)

    def _finish(self, req: EngineRequest, reason: str) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        req.metrics.finished_time = time.perf_counter()
        self.scheduler.remove(req)

    def _output(self, req: EngineRequest) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_ids), req.text, list(req.output_ids),
                             req.finished, req.finish_reason, req.metrics, req.error)

    # ---------------------------------------------------------------- whole batches
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, images=None,
                 progress: bool = True) -> list[RequestOutput]:
        """Run ``prompts`` (a str or a list) to the end; the final outputs in prompt order."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        imgs = images if images is not None else [None] * len(prompts)
        if len(imgs) != len(prompts):
            raise ValueError(f"images must hold one list per prompt ({len(prompts)}), got {len(imgs)}")
        rids = []
        try:
            for p, sp, im in zip(prompts, plist, imgs):
                rids.append(self.add_request(p, sp, im))
        except Exception:
            for rid in rids:
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(rids), unit="req", disable=not progress, leave=False) as bar:
            while len(final) < len(rids):
                for out in self.step():
                    if out.finished and out.request_id in rids:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[r] for r in rids]

    # ---------------------------------------------------------------- metrics
    def stats(self) -> dict:
        """Gauges and counters with vLLM's names (KV blocks and KDA state slots apart; hits in tokens)."""
        cache, lay, pc = self.cache, self.cache.layout, self.prefix
        evictable = pc.num_evictable() if pc else 0
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": 1 - (cache.num_free_blocks + evictable) / lay.num_blocks,
            "kda_state_usage_perc": 1 - cache.num_free_state_slots / lay.num_state_slots,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": pc.queries if pc else 0,
            "prefix_cache_hits": pc.hits if pc else 0,
            "prefix_cache_hits_kv": pc.kv_hits if pc else 0,
            "prefix_cache_hits_kda": pc.kda_hits if pc else 0,
            "kda_checkpoints": len(pc.checkpoints) if pc else 0,
            "cuda_graph_replays": self.graphs.replays if self.graphs else 0,
            "packed_steps": self.runner.packed_steps,
            "step_graph_replays": self.runner.step_graphs.replays if self.runner.step_graphs else 0,
            "step_graph_captures": self.runner.step_graphs.captures if self.runner.step_graphs else 0,
            "step_graph_capture_seconds": self.runner.step_graphs.capture_seconds if self.runner.step_graphs else 0.0,
            "decode_steps": self.decode_steps, "decode_tokens": self.decode_tokens,
            "decode_seconds": self.decode_seconds,
            "prefill_steps": self.prefill_steps, "prefill_seconds": self.prefill_seconds,
            "step_times": dict(self.runner.step_times),  # how steps ran -> (steps, wall seconds of the forward)
            "memory": dict(self.budget),
        }


def _media_keys(ids: list[int], features: list[torch.Tensor], pad: int) -> list[bytes | None]:
    """Per token: None for text; for a media token its item's digest and index (for block names)."""
    digests = [hashlib.blake2b(f.detach().float().cpu().numpy().tobytes(), digest_size=16).digest()
               for f in features]
    out: list[bytes | None] = []
    item, k = -1, 0
    for j, t in enumerate(ids):
        if t != pad:
            out.append(None)
            continue
        if j == 0 or ids[j - 1] != pad or k == features[item].shape[0]:
            item, k = item + 1, 0
        out.append(digests[item] + k.to_bytes(4, "little"))
        k += 1
    return out
