"""What a request asks for (``SamplingParams``) and what the engine hands back (``RequestOutput`` with
its ``RequestMetrics``), with vLLM's names so a reader of one knows the other.

Every field is checked when the params are made, so a bad value is a ValueError/TypeError naming the
field and the fix before the engine has queued anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .requests import SEED_END, is_real


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each new token and when to stop."""

    temperature: float = 1.0  # 0 = greedy argmax; > 0 samples softmax(logits / temperature)
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 keeps every token
    top_k: int = 0  # keep the k most likely tokens before top_p; 0 keeps all
    max_tokens: int = 16  # new tokens at most (>= 1)
    seed: int | None = None  # seeds this request's sampler; None draws one
    stop: tuple[str, ...] | None = None  # strings that end the text (not included in it)
    ignore_eos: bool = False  # keep going after eos (to time a model that would stop early)

    def __post_init__(self) -> None:
        if not is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p!r} must be in (0, 1] (1 disables nucleus sampling)")
        for name in ("top_k", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k} must be >= 0 (0 keeps every token)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens} must be >= 1")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed < SEED_END:
            raise ValueError(f"seed = {self.seed} is outside [0, 2**64): torch seeds are unsigned 64-bit")
        object.__setattr__(self, "stop", _check_stop(self.stop))


def _check_stop(stop) -> tuple[str, ...] | None:
    if stop is None:
        return None
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise TypeError(f"stop must be a str or a list of str, got {stop!r}")
    if any(s == "" for s in items):
        raise ValueError("stop holds an empty string, which would end every text at once; remove it")
    return tuple(items) or None


@dataclass
class RequestMetrics:
    """Timestamps of one request (time.perf_counter seconds) and the latencies vLLM reports from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (last admission)
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled step."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """Arrival to the last token (end to end)."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (n - 1); None for one token."""
        n = len(self.token_times)
        if self.e2e is None or n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    """One request as it stands after a step (``text`` and ``token_ids`` so far)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (eos or a stop string), "length", "abort" or "error"
    metrics: RequestMetrics
    error: str | None = None  # what failed, when finish_reason is "error"
