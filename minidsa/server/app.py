"""The HTTP service: the standard library's ThreadingHTTPServer, routing, JSON and server-sent events.

    server = start_server(minidsa.load("default"), port=0)   # listening on 127.0.0.1, a free port
    OpenAI(base_url=server.url + "/v1", api_key="none").completions.create(prompt="hi", max_tokens=8)
    server.close()

Routes: POST /v1/completions, POST /v1/chat/completions (both with ``stream``), GET /v1/models,
GET /health and GET /metrics; HEAD answers each GET route with the GET's status and headers and no body.
Requests may name the model by the served name (``model_name``, the one /v1/models lists) or by its
config's name. A connection is one thread (``ThreadingHTTPServer``, which parses HTTP);
the engine is stepped by one more (worker.py); a request waits on its own queue.

Streams are ``text/event-stream``, one ``data: {json}`` event per engine step that produced text, then
``data: [DONE]``, on an HTTP/1.1 response that ends when the connection closes (``Connection: close``):
no chunked framing to write, and every client reads it. Headers go out with the first token, so a
request the engine refuses (a prompt too long for the context, say) still gets a plain 400.

A client that goes away is noticed either when a write fails or, while its request waits for tokens,
by polling its socket (readable with nothing to read = closed); its request is then aborted, which gives
its KV blocks and state slot back at once. ``close()`` stops accepting, aborts what is live (its readers
answer 503 or end their stream with an error event), shuts the open connections and joins their threads.
The server binds 127.0.0.1 unless told otherwise: it has no authentication.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from ..model.minidsa import MiniDSA
from ..serving.engine import Engine
from ..serving.params import RequestOutput
from ..serving.requests import Prompt, check_positive_int
from . import chat, protocol
from .metrics import exposition
from .protocol import APIError, Job
from .worker import SHUTDOWN, Handle, Overloaded, Worker

POLL_S = 0.05  # how often a request waiting for tokens checks that its client is still there
MAX_BODY_BYTES = 64 << 20  # a request body larger than this (base64 images) is refused with 413
WAITING_PER_SEQ = 4  # default max_waiting_requests: this many times max_num_seqs
CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class ClientGone(Exception):
    """The client closed its connection while its request ran."""


class Server:
    """An OpenAI-compatible HTTP server over one ``Engine`` of ``model``; a context manager.

    ``model_name`` is the served name, the one /v1/models lists and answers carry (None: the config's
    name); requests may also name the config (``model_names`` holds both)."""

    def __init__(self, model: MiniDSA, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                 max_waiting_requests: int | None = None, **engine_kw) -> None:
        if not isinstance(model, MiniDSA):
            raise TypeError(f"model must be a MiniDSA (minidsa.load(...)), got {type(model).__name__}")
        if model_name is not None and (not isinstance(model_name, str) or not model_name.strip()):
            raise ValueError(f"model_name = {model_name!r} must be a non-empty string (None: the config's name)")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port = {port!r} must be an int in [0, 65535] (0 picks a free port)")
        self.model, self.engine = model, Engine(model, **engine_kw)
        self.model_name = model.config.name if model_name is None else model_name
        self.model_names = tuple(dict.fromkeys((self.model_name, model.config.name)))  # the listed one first
        limit = WAITING_PER_SEQ * self.engine.max_num_seqs if max_waiting_requests is None else max_waiting_requests
        check_positive_int("max_waiting_requests", limit)
        self.worker = Worker(self.engine, limit)
        try:
            self.httpd = _HTTPServer((host, port), self)
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {host}:{port} ({e.strerror}); pick another port "
                                   f"(--port N, or port=0 for a free one)") from None
        self.host, self.port = host, self.httpd.server_address[1]
        self.created = int(time.time())
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._close_lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Server":
        self.worker.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="minidsa-http", daemon=True)
        self._thread.start()
        return self

    def wait(self) -> None:
        """Block until ``close()`` (a timed wait, so Ctrl-C reaches the main thread at once)."""
        while not self._closed.wait(0.5):
            pass

    def wait_for_stop(self) -> None:
        """Block until Ctrl-C, SIGTERM (what ``kill`` and service managers send) or ``close()``; the caller's
        ``with`` block then closes the server. Signals reach the main thread only: elsewhere only ``close()``."""
        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, _interrupt) if main else None
        try:
            self.wait()
        except KeyboardInterrupt:
            pass
        finally:
            if main:
                signal.signal(signal.SIGTERM, before)

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, abort live requests, stop the engine thread, close connections; idempotent."""
        with self._close_lock:
            if self._closed.is_set():
                return
            if self._thread is not None:
                self.httpd.shutdown()  # returns once serve_forever has stopped accepting
                self._thread.join(timeout)
            self.worker.stop(timeout)
            self.httpd.close_connections(timeout)
            self.httpd.server_close()
            self._closed.set()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_server(model: MiniDSA, host: str = "127.0.0.1", port: int = 0, model_name: str | None = None,
                 **engine_kw) -> Server:
    """A started Server (``port=0``: a free port, read back from ``server.port``); returns once listening.
    ``engine_kw`` go to ``Engine`` (``max_num_seqs``, ...), plus ``max_waiting_requests`` (the 503 limit)."""
    return Server(model, host, port, model_name, **engine_kw).start()


def serve(model: MiniDSA, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          **engine_kw) -> None:
    """Serve until Ctrl-C or SIGTERM (then close cleanly and return)."""
    with start_server(model, host, port, model_name, **engine_kw) as server:
        server.wait_for_stop()


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM ends serving as Ctrl-C does


class _HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that knows its open connections, so ``close()`` can end and join them."""

    daemon_threads = True  # a backstop: close() joins them; a stuck one must not keep the process alive
    request_queue_size = 128  # the listen backlog; 32 clients connecting at once must not be dropped

    def __init__(self, address, app: Server) -> None:
        super().__init__(address, _Handler)
        self.app = app
        self.open: dict[socket.socket, threading.Thread] = {}
        self.open_lock = threading.Lock()
        self.busy = 0  # requests being answered (under idle's lock)
        self.idle = threading.Condition()

    @contextlib.contextmanager
    def answering(self):
        """Marks a request in progress, so close() lets it write its last words before cutting connections."""
        with self.idle:
            self.busy += 1
        try:
            yield
        finally:
            with self.idle:
                self.busy -= 1
                self.idle.notify_all()

    def process_request_thread(self, request, client_address) -> None:
        with self.open_lock:
            self.open[request] = threading.current_thread()
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.open_lock:
                self.open.pop(request, None)

    def close_connections(self, timeout: float) -> None:
        """Let requests in progress finish (their engine requests are already stopped), then shut every
        connection, so threads blocked reading a next request wake up, and join them."""
        with self.idle:
            self.idle.wait_for(lambda: self.busy == 0, timeout)
        with self.open_lock:
            items = list(self.open.items())
        for sock, _ in items:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # a thread blocked reading the next request wakes up
            except OSError:
                pass
        for _, thread in items:
            thread.join(timeout)


class _Handler(BaseHTTPRequestHandler):
    """One connection: routes each request; errors are OpenAI error bodies, never a traceback to the client."""

    protocol_version = "HTTP/1.1"
    server_version = "minidsa"
    server: _HTTPServer

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_PATCH(self) -> None:
        self._route("PATCH")

    def log_message(self, format, *args) -> None:
        pass  # no line per request; log_error below still reports failures

    def log_error(self, format, *args) -> None:
        sys.stderr.write(f"minidsa server: {self.address_string()} {format % args}\n")

    @property
    def app(self) -> Server:
        return self.server.app

    def _route(self, method: str) -> None:
        self._sent = False  # whether a status line has gone out (after that, errors end a stream instead)
        self._head = method == "HEAD"  # headers as GET would send them, never a body (RFC 9110 9.3.2)
        self._polled = time.monotonic()  # when the client's socket was last checked
        self._unread = self.headers.get("Content-Length", "0") != "0"  # a body not read yet
        path = urlsplit(self.path).path.rstrip("/") or "/"
        methods = ROUTES.get(path)
        with self.server.answering():
            self._dispatch(method, path, methods)

    def _dispatch(self, method: str, path: str, methods: dict | None) -> None:
        try:
            if methods is None:
                raise APIError(404, f"no route {path!r}; this server has {', '.join(sorted(ROUTES))}",
                               type="invalid_request_error", code="not_found")
            allowed = [*methods, "HEAD"] if "GET" in methods else list(methods)
            if method not in allowed:
                raise APIError(405, f"{method} is not allowed on {path}; use {' or '.join(allowed)}",
                               code="method_not_allowed", headers={"Allow": ", ".join(allowed)})
            methods["GET" if method == "HEAD" else method](self)
        except APIError as e:
            self._error(e)
        except CLIENT_GONE:
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 -- one request fails, the server goes on
            self.log_error("internal error on %s %s: %r", method, path, e)
            self._error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error",
                                 code="internal_error"))

    # ------------------------------------------------------------------ bodies out
    def _json(self, status: int, body, headers: dict | None = None, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        if self._unread:  # an unread request body would be parsed as the next request: close instead
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self._sent = True
        if not self._head:
            self.wfile.write(data)

    def _error(self, e: APIError) -> None:
        try:
            if self._sent:  # a stream is under way: its last event says what went wrong
                self._event(e.body())
                self._event("[DONE]")
            else:
                self._json(e.status, e.body(), e.headers)
        except CLIENT_GONE:
            self.close_connection = True

    def _event(self, body) -> None:
        data = body if isinstance(body, str) else json.dumps(body)
        self.wfile.write(f"data: {data}\n\n".encode())

    def _read_json(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise APIError(411, f"Content-Length = {length!r}: send the JSON body with its length", code="length_required")
        if int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"the body is {length} bytes, more than {MAX_BODY_BYTES}; send smaller images",
                           code="body_too_large")
        raw = self.rfile.read(int(length))
        self._unread = False
        return protocol.parse_body(raw)

    # ------------------------------------------------------------------ routes
    def _health(self) -> None:
        if not self.app.worker.alive:
            raise APIError(503, "the engine thread is not running", type="server_error", code="engine_dead")
        self._json(200, {"status": "ok"})

    def _models(self) -> None:
        app = self.app
        self._json(200, {"object": "list", "data": [
            {"id": app.model_name, "object": "model", "created": app.created, "owned_by": "minidsa",
             "max_model_len": app.model.config.max_seq_len}]})

    def _metrics(self) -> None:
        try:
            stats = self.app.worker.stats()
        except TimeoutError as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
        text = exposition(stats, self.app.worker.histograms, self.app.model_name)
        self._json(200, text, content_type="text/plain; version=0.0.4; charset=utf-8")

    def _completions(self) -> None:
        job = protocol.completion_job(self._read_json(), self.app.model_names)
        prompt = chat.prepare(self.app.model, job.prompt, [], field="prompt")
        protocol.check_fits(job, len(prompt.ids), self.app.model.config.max_seq_len)
        self._run(job, prompt)

    def _chat(self) -> None:
        body = self._read_json()
        protocol.check_fields(body, chat=True)  # these two before decoding images for nothing
        protocol.check_model(body, self.app.model_names)
        text, images = chat.render(body.get("messages"))
        prompt, context = chat.prepare(self.app.model, text, images), self.app.model.config.max_seq_len
        job = protocol.chat_job(body, self.app.model_names, text, images, context - len(prompt.ids))
        protocol.check_fits(job, len(prompt.ids), context)
        self._run(job, prompt)

    # ------------------------------------------------------------------ one request through the engine
    def _run(self, job: Job, prompt: Prompt) -> None:
        """``prompt``: the job's prompt encoded once here; the engine queues it as it is."""
        try:
            handle = self.app.worker.submit(prompt, job.params)
        except Overloaded as e:
            raise APIError(503, f"the server is overloaded: {e}; retry later", type="server_error",
                           code="overloaded", headers={"Retry-After": "1"}) from None
        try:
            self._stream(job, handle) if job.stream else self._answer(job, handle)
        except (ClientGone, *CLIENT_GONE):
            self.app.worker.abort(handle)
            self.close_connection = True

    def _answer(self, job: Job, handle: Handle) -> None:
        event = self._next(handle)
        while isinstance(event, RequestOutput) and not event.finished:
            event = self._next(handle)
        self._json(200, protocol.response(job, _progress(event)))

    def _stream(self, job: Job, handle: Handle) -> None:
        out = _progress(self._next(handle))  # a refused request is still a plain error response
        self.send_response(200)
        for k, v in (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"), ("Connection", "close")):
            self.send_header(k, v)
        self.end_headers()
        self._sent, self.close_connection = True, True
        name, sent, first = job.model, 0, True
        if job.chat:  # OpenAI's first chat chunk: the role, no text yet
            self._event(protocol.chunk(job, name, "", role=True))
            first = False
        while True:
            n = max(sent, protocol.ready_text(out.text, job.params.stop, out.finished))
            if out.finished:
                self._event(protocol.chunk(job, name, out.text[sent:n], out.finish_reason))
                break
            if n > sent or first:  # an event goes out with the first token, even one without text yet
                self._event(protocol.chunk(job, name, out.text[sent:n]))
            sent, first = n, False
            out = _progress(self._next(handle))
        if job.include_usage:
            self._event(protocol.chunk(job, name, None, usage_of=out))
        self._event("[DONE]")

    def _next(self, handle: Handle):
        """The request's newest event (outputs are cumulative, so older unread ones are skipped). Checks
        every POLL_S that the client is still there: a plain request writes nothing until it ends."""
        while True:
            try:
                event = handle.outputs.get(timeout=POLL_S)
            except queue.Empty:
                event = None
            if time.monotonic() - self._polled > POLL_S or event is None:
                self._polled = time.monotonic()
                if self._client_gone():
                    raise ClientGone
            if event is not None:
                break
            if not self.app.worker.alive:
                return SHUTDOWN
        while isinstance(event, RequestOutput) and not event.finished:
            try:
                event = handle.outputs.get_nowait()
            except queue.Empty:
                break
        return event

    def _client_gone(self) -> bool:
        """A peek that does not wait: b"" means the client closed its end; no data yet means it is there.
        (Not select(): it cannot watch descriptors past 1023, which a long-running server reaches.)"""
        sock = self.connection
        try:
            timeout = sock.gettimeout()
            sock.settimeout(0)
            try:
                return sock.recv(1, socket.MSG_PEEK) == b""
            finally:
                sock.settimeout(timeout)
        except BlockingIOError:
            return False
        except OSError:
            return True


def _progress(event) -> RequestOutput:
    """An output that is not a failure (a refusal, SHUTDOWN or a failed finish raise their APIError)."""
    if isinstance(event, APIError):
        raise event
    if event is SHUTDOWN:
        raise APIError(503, "the server is shutting down; the request was stopped", type="server_error",
                       code="shutting_down")
    if event.finished and event.finish_reason not in ("stop", "length"):
        raise protocol.failure(event)
    return event


ROUTES = {
    "/v1/completions": {"POST": _Handler._completions},
    "/v1/chat/completions": {"POST": _Handler._chat},
    "/v1/models": {"GET": _Handler._models},
    "/health": {"GET": _Handler._health},
    "/metrics": {"GET": _Handler._metrics},
}
