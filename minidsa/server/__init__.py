"""The OpenAI-compatible HTTP service on the serving engine: ``python -m minidsa serve`` (docs/design.md §16).

- ``protocol.py``: request bodies checked into engine requests; response, chunk and error bodies.
- ``chat.py``: chat messages -> the model's prompt format and its images (data URLs).
- ``metrics.py``: GET /metrics, the engine's stats and request latencies as Prometheus text.
- ``worker.py``: the one thread that steps the engine; per-request output queues; the overload limit.
- ``app.py``: the ThreadingHTTPServer, routing, server-sent events, disconnects; ``start_server``, ``serve``.
"""

from .app import Server, serve, start_server
from .protocol import APIError

__all__ = ["APIError", "Server", "serve", "start_server"]
