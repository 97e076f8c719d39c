"""GET /metrics: the engine's stats and per-request latencies in the Prometheus text format (version 0.0.4).

Names are ``minidsa:<engine.stats() name>``, vLLM's scheme with our prefix, so a vLLM dashboard needs only
the prefix changed: gauges as they are (``minidsa:num_requests_running``, ``minidsa:kv_cache_usage_perc``,
``minidsa:kda_state_usage_perc``), counters with ``_total`` (``minidsa:prompt_tokens_total``,
``minidsa:prefix_cache_hits_total``). Finished requests add ``minidsa:request_success_total`` by
``finished_reason`` (the engine's: stop, length, abort, error) and histograms of their time to first
token, time per output token, end-to-end latency and queue time. Every sample carries ``model_name``.

The format is a few lines of text per metric (HELP, TYPE, samples), written here rather than pulled from a
client library the package does not otherwise need; the tests read it back with prometheus_client's parser.
``Histograms`` is written by the engine thread and read by HTTP threads, so it holds a lock.
"""

from __future__ import annotations

import bisect
import threading

from ..serving.params import RequestOutput

COUNTERS = {
    "prompt_tokens": "Prompt tokens computed (prefill), cached ones excluded.",
    "generation_tokens": "Output tokens sampled.",
    "num_preemptions": "Requests preempted (recompute) for want of KV blocks.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens served from the prefix cache (KV and KDA state).",
    "prefix_cache_hits_kv": "Prompt tokens whose KV blocks matched, before the KDA checkpoint clamp.",
    "prefix_cache_hits_kda": "Prompt tokens resumed from a KDA state checkpoint.",
    "cuda_graph_replays": "Decode steps replayed from a CUDA graph.",
}
GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV blocks in use (cached blocks that can be evicted count as free).",
    "kda_state_usage_perc": "Fraction of KDA state slots in use.",
    "kda_checkpoints": "KDA state checkpoints held by the prefix cache.",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("ttft", "Arrival to the first sampled token."),
    "time_per_output_token_seconds": ("tpot", "Time per output token after the first."),
    "e2e_request_latency_seconds": ("e2e", "Arrival to the last token."),
    "request_queue_time_seconds": ("queue_time", "Arrival to the first scheduled step."),
}
# vLLM's latency buckets, in seconds
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
           80.0, 160.0, 640.0, 2560.0)


class Histograms:
    """Latency histograms and finish-reason counts over the requests that have finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {name: [0] * (len(BUCKETS) + 1) for name in HISTOGRAMS}  # per bucket, the last is +Inf
        self.sums = dict.fromkeys(HISTOGRAMS, 0.0)
        self.finished: dict[str, int] = {}

    def count(self, reason: str) -> None:
        """Count a request that ended without an output to observe (aborted when its client left)."""
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def observe(self, out: RequestOutput) -> None:
        """Count one finished request and file its latencies."""
        self.count(out.finish_reason)
        with self._lock:
            for name, (attr, _) in HISTOGRAMS.items():
                v = getattr(out.metrics, attr)
                if v is not None:
                    self.counts[name][bisect.bisect_left(BUCKETS, v)] += 1
                    self.sums[name] += v

    def render(self, labels: dict) -> list[str]:
        with self._lock:
            lines = _family("request_success_total", "counter", "Finished requests by the engine's finish reason.")
            for reason in sorted(self.finished):
                lines.append(_sample("request_success_total", {**labels, "finished_reason": reason},
                                     self.finished[reason]))
            for name, (_, text) in HISTOGRAMS.items():
                lines += _family(name, "histogram", text)
                total = 0
                for le, n in zip((*map(repr, BUCKETS), "+Inf"), self.counts[name]):
                    total += n
                    lines.append(_sample(name + "_bucket", {**labels, "le": le}, total))
                lines.append(_sample(name + "_sum", labels, self.sums[name]))
                lines.append(_sample(name + "_count", labels, total))
        return lines


def exposition(stats: dict, histograms: Histograms, model_name: str) -> str:
    """The whole /metrics page from an ``engine.stats()`` snapshot and the finished requests."""
    labels = {"model_name": model_name}
    lines = []
    for name, text in GAUGES.items():
        lines += _family(name, "gauge", text) + [_sample(name, labels, stats[name])]
    for name, text in COUNTERS.items():
        lines += _family(name + "_total", "counter", text) + [_sample(name + "_total", labels, stats[name])]
    lines += histograms.render(labels)
    return "\n".join(lines) + "\n"


def _family(name: str, kind: str, text: str) -> list[str]:
    return [f"# HELP minidsa:{name} {text}", f"# TYPE minidsa:{name} {kind}"]


def _sample(name: str, labels: dict, value) -> str:
    pairs = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return f"minidsa:{name}{{{pairs}}} {float(value)!r}"


def _escape(v: str) -> str:
    """A label value as the text format quotes it."""
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
