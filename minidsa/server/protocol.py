"""The OpenAI wire format: request bodies checked into engine requests, and the response, chunk and error
bodies built from the engine's outputs.

A bad field is an ``APIError`` (HTTP 400) whose body is OpenAI's,
``{"error": {"message", "type": "invalid_request_error", "param": <the field>, "code"}}``, so a client
shows the user which field to fix. Fields the engine cannot honour (``n`` > 1, ``logprobs``, ``echo``,
penalties, tools) are refused by name rather than silently ignored: an answer that looks right but
ignored what was asked is worse than an error. ``top_k`` and ``ignore_eos`` are accepted as vLLM's
extensions (``extra_body`` in the openai client). A field the endpoint does not know is refused too
(``check_fields``), as OpenAI refuses an unrecognised argument: a misspelt ``max_token`` would otherwise
generate the default 16 tokens without a word. The fields accepted and ignored are IGNORED, a short list
of bookkeeping requests that never change the answer.

Defaults are OpenAI's: completions ``max_tokens`` 16, chat ``max_tokens`` what fits the context (capped
at CHAT_MAX_TOKENS), ``temperature`` 1, ``top_p`` 1. The engine's "abort" and "error" finish reasons are
never reported as a success; only "stop" and "length" reach a client as ``finish_reason``.
"""

from __future__ import annotations

import difflib
import json
import math
import time
import uuid
from dataclasses import dataclass, field

from ..serving.params import RequestOutput, SamplingParams
from ..serving.requests import SEED_END

CHAT_MAX_TOKENS = 256  # a chat reply without max_tokens gets what fits the context, at most this

# field -> the values that ask for nothing the engine lacks (None = absent)
UNSUPPORTED = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False),
               "top_logprobs": (None, 0), "suffix": (None, ""), "logit_bias": (None, {}),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "tools": (None, []),
               "response_format": (None, {"type": "text"}), "tool_choice": (None, "none", "auto"),
               "functions": (None, []), "function_call": (None, "none", "auto"), "modalities": (None, ["text"]),
               "store": (None, False)}
# The fields each endpoint reads, beside UNSUPPORTED's (top_k and ignore_eos are vLLM's extensions)
COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
                           "stream", "stream_options"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
# Accepted and ignored: they ask a hosted service for bookkeeping (the end user's id for abuse monitoring,
# tags, a prompt-cache key, a processing tier, parallel tool calls when tools are refused anyway), never
# for a different answer, and clients send them on their own. Any other unknown field is a 400.
IGNORED = frozenset({"user", "safety_identifier", "metadata", "prompt_cache_key", "service_tier",
                     "parallel_tool_calls"})


class APIError(Exception):
    """An HTTP error with OpenAI's error body; ``headers`` go out with it (Retry-After, Allow)."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param)


@dataclass
class Job:
    """One checked request: what the engine runs and how the answer is shaped."""

    chat: bool
    prompt: str
    params: SamplingParams
    images: list = field(default_factory=list)  # H x W x 3 uint8 arrays, in prompt order
    stream: bool = False
    include_usage: bool = False
    max_name: str = "max_tokens"  # the field that set params.max_tokens (chat may use max_completion_tokens)
    model: str = ""  # the served name the request used, which its answer carries (as vLLM answers)
    id: str = ""
    created: int = 0


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body; 400 for anything else."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid(None, f"the request body is not valid JSON ({e}); send a JSON object with "
                            f"Content-Type: application/json") from None
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got a JSON {type(body).__name__}")
    return body


def check_model(body: dict, served: tuple[str, ...]) -> str:
    """The name the answer carries: ``model`` if it is one of the ``served`` names, the first of them (the
    listed one) if ``model`` is missing; another name is a 404, as OpenAI and vLLM answer."""
    name = body.get("model")
    if name is None:
        return served[0]
    if not isinstance(name, str):
        raise invalid("model", f"model must be a string, got {_show(name)}")
    if name not in served:
        also = f" (also accepted: {', '.join(repr(s) for s in served[1:])})" if served[1:] else ""
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{served[0]}'{also}; "
                            f"GET /v1/models lists it", "model", code="model_not_found")
    return name


def check_fields(body: dict, chat: bool) -> None:
    """400 naming every field of ``body`` that the endpoint (chat or completions) neither reads, refuses by
    value (UNSUPPORTED) nor ignores (IGNORED), with the known field it most resembles; ``param`` is the
    first of them. OpenAI answers such a request the same way ("Unrecognized request argument")."""
    reads, other = (CHAT_FIELDS, COMPLETION_FIELDS) if chat else (COMPLETION_FIELDS, CHAT_FIELDS)
    unknown = [k for k in body if k not in reads and k not in UNSUPPORTED and k not in IGNORED]
    if not unknown:
        return
    endpoint, elsewhere = ("/v1/chat/completions", "/v1/completions") if chat else ("/v1/completions",
                                                                                     "/v1/chat/completions")
    hints = []
    for k in unknown:
        if k in other:  # e.g. messages sent to /v1/completions
            hints.append(f"{k} is a field of {elsewhere}")
        elif m := difflib.get_close_matches(k, sorted(reads | UNSUPPORTED.keys()), n=1, cutoff=0.75):
            hints.append(f"{k}: did you mean {m[0]}?")
    raise invalid(unknown[0], f"unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: "
                              f"{', '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else "") +
                  f"; {endpoint} reads {', '.join(sorted(reads))} and ignores only {', '.join(sorted(IGNORED))}; "
                  f"correct the name or leave the field out")


def completion_job(body: dict, served: tuple[str, ...]) -> Job:
    """POST /v1/completions: ``prompt`` is a string (or a list holding one); ``served``: the names
    ``model`` may take, the listed one first. Unknown fields are a 400 (check_fields)."""
    check_fields(body, chat=False)
    model = check_model(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt", f"prompt must be a string, got {_show(prompt)}; send one request per prompt "
                                f"(batches and token-id prompts are not supported)")
    return _job(body, False, prompt, [], _get(body, "max_tokens", int, 16), model)


def chat_job(body: dict, served: tuple[str, ...], prompt: str, images: list, room: int) -> Job:
    """POST /v1/chat/completions, its messages already rendered (chat.py); ``room``: context left after
    the prompt, the default ``max_tokens``. Unknown fields are a 400 (check_fields; the app checks them
    before rendering, so a misspelt field costs no image decoding)."""
    check_fields(body, chat=True)
    model = check_model(body, served)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _job(body, True, prompt, images, _get(body, name, int, max(1, min(room, CHAT_MAX_TOKENS))), model,
                name)


def _job(body: dict, chat: bool, prompt: str, images: list, max_tokens: int, model: str,
         max_name: str = "max_tokens") -> Job:
    for name, allowed in UNSUPPORTED.items():
        v = body.get(name)
        if not any(v is a or v == a and isinstance(v, bool) == isinstance(a, bool) for a in allowed):
            raise invalid(name, f"{name} = {_show(v)} is not supported by this server; leave it out")
    if max_tokens < 1:
        raise invalid(max_name, f"{max_name} = {max_tokens} must be >= 1")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream = true")
    usage = (options or {}).get("include_usage", False)
    if not isinstance(usage, bool):
        raise invalid("stream_options", f"stream_options.include_usage must be a boolean, got {_show(usage)}")
    try:  # every field was checked above; SamplingParams checks again, and its word is final
        params = SamplingParams(temperature=float(_temperature(body)), top_p=float(_top_p(body)),
                                top_k=_top_k(body), max_tokens=max_tokens, seed=_seed(body), stop=_stop(body),
                                ignore_eos=_get(body, "ignore_eos", bool, False))
    except (ValueError, TypeError) as e:
        raise invalid(None, str(e)) from None
    return Job(chat, prompt, params, images, stream, usage, max_name, model,
               ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()))


def check_fits(job: Job, prompt_len: int, context: int) -> None:
    """400 unless the prompt (``prompt_len`` tokens, bos and image tokens included) and max_tokens fit the
    model's context (the engine checks again; this names the request's own field)."""
    if prompt_len >= context:
        raise invalid("messages" if job.chat else "prompt", f"the prompt is {prompt_len} tokens (bos and image "
                      f"tokens included) and leaves no room for an answer in the model's context of {context} "
                      f"tokens (max_model_len); shorten it to at most {context - 1} tokens")
    if prompt_len + job.params.max_tokens > context:
        raise invalid(job.max_name, f"the prompt is {prompt_len} tokens and {job.max_name} = {job.params.max_tokens}: "
                                    f"together more than the model's context of {context} tokens (max_model_len); "
                                    f"use {job.max_name} <= {context - prompt_len}")


def _temperature(body: dict) -> float:
    t = _get(body, "temperature", float, 1.0)
    if not math.isfinite(t) or t < 0:
        raise invalid("temperature", f"temperature = {t!r} must be a finite number >= 0 (0 = greedy)")
    return t


def _top_p(body: dict) -> float:
    p = _get(body, "top_p", float, 1.0)
    if not 0 < p <= 1:
        raise invalid("top_p", f"top_p = {p!r} must be in (0, 1] (1 keeps every token)")
    return p


def _top_k(body: dict) -> int:
    k = _get(body, "top_k", int, 0)
    if k < -1:
        raise invalid("top_k", f"top_k = {k} must be >= 0 (0 or -1 keep every token)")
    return max(k, 0)


def _seed(body: dict) -> int | None:
    s = _get(body, "seed", int, None)
    if s is not None and not 0 <= s < SEED_END:
        raise invalid("seed", f"seed = {s} must be in [0, 2**64)")
    return s


def _stop(body: dict) -> tuple[str, ...] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid("stop", f"stop must be a string or a list of strings, got {_show(stop)}")
    if "" in items:
        raise invalid("stop", "stop holds an empty string, which would end every answer at once; remove it")
    return tuple(items) or None


def _get(body: dict, name: str, kind: type, default):
    """body[name] checked against a JSON type (an int passes as a float; a boolean never as a number)."""
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, kind) and (kind is bool or not isinstance(v, bool))
    if kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok:
        what = {int: "an integer", float: "a number", bool: "a boolean", dict: "an object"}[kind]
        raise invalid(name, f"{name} must be {what}, got {_show(v)}")
    return v


def _show(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------------ answers
def usage(out: RequestOutput) -> dict:
    n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def response(job: Job, out: RequestOutput) -> dict:
    """The whole answer of a request that finished with "stop" or "length"."""
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                  "finish_reason": out.finish_reason}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
    return {"id": job.id, "object": "chat.completion" if job.chat else "text_completion", "created": job.created,
            "model": job.model, "choices": [choice], "usage": usage(out)}


def chunk(job: Job, model: str, text: str | None, finish_reason: str | None = None, role: bool = False,
          usage_of: RequestOutput | None = None) -> dict:
    """One streamed event: a text piece, the finish reason, or (``usage_of``) the closing usage with no choice."""
    if usage_of is not None:
        choices = []
    elif job.chat:
        delta = {"role": "assistant", "content": text or ""} if role else {"content": text} if text else {}
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    body = {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": job.created, "model": model, "choices": choices}
    if job.include_usage:
        body["usage"] = None if usage_of is None else usage(usage_of)
    return body


def ready_text(text: str, stop: tuple[str, ...] | None, finished: bool) -> int:
    """How much of ``text`` may be streamed: all of it once finished, else all but a tail that could be
    the start of a stop string (the engine cuts a stop string only when it is whole; the tail it cuts
    must not have been sent)."""
    if finished or not stop:
        return len(text)
    hold = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return len(text) - hold


def failure(out: RequestOutput) -> APIError:
    """The error a request that ended without an answer gets ("abort": the server is stopping; "error")."""
    if out.finish_reason == "abort":
        return APIError(503, "the server is shutting down; the request was stopped", type="server_error",
                        code="shutting_down")
    return APIError(500, f"the engine failed on this request: {out.error or 'no cause was recorded'}",
                    type="server_error", code="internal_error")
