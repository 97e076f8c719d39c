"""The one thread that drives the engine. The engine is not thread-safe, so nothing else touches it:
HTTP threads put commands on one queue (add, abort, a stats snapshot, stop) and each request reads its
outputs from a queue of its own.

The loop: take the commands that have come in (waiting for one when the engine is idle), then run one
engine step and hand every output to its request's queue. Outputs are cumulative (the text so far), so a
reader that falls behind may skip to the newest.

Overload is decided at submission, in the caller's thread: at most ``max_waiting`` requests may be
submitted and not yet scheduled (a request leaves that count with its first step, or when it is refused
or aborted). Past it ``submit`` raises ``Overloaded`` and the HTTP layer answers 503: a queue that grows
without bound only turns overload into time-outs, after the client has waited for them.

A step that raises (the engine fails a request's forward by itself; this is anything else) fails the
requests then live with an error and the loop goes on; it never takes the server down.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
import uuid
from dataclasses import dataclass, field

from ..serving.engine import Engine
from ..serving.params import SamplingParams
from ..serving.requests import Prompt
from .metrics import Histograms
from .protocol import APIError

SHUTDOWN = "shutdown"  # put on a request's queue when the server stops before the request finished


class Overloaded(Exception):
    """Too many requests are waiting to be scheduled (or the worker is stopping); retry later."""


@dataclass
class Handle:
    """One submitted request as its HTTP thread sees it: its id and the queue its outputs arrive on.
    The queue carries RequestOutputs, then an APIError (refused by the engine) or SHUTDOWN at most once."""

    request_id: str
    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    waiting: bool = True  # submitted and not yet scheduled (counts against max_waiting)


class Worker:
    """The engine thread: ``submit``/``abort``/``stats`` from any thread, ``start``/``stop`` by the owner."""

    def __init__(self, engine: Engine, max_waiting: int) -> None:
        self.engine, self.max_waiting = engine, max_waiting
        self.histograms = Histograms()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _num_waiting and _stopping
        self._num_waiting = 0
        self._stopping = False
        self._live: dict[str, Handle] = {}  # worker thread only
        self._thread = threading.Thread(target=self._run, name="minidsa-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every live request (their readers get SHUTDOWN), end the loop and join it."""
        with self._lock:
            self._stopping = True
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, prompt: Prompt, params: SamplingParams) -> Handle:
        """Queue a request; ``Overloaded`` if ``max_waiting`` are already waiting or the worker is stopping."""
        with self._lock:
            if self._stopping:
                raise Overloaded("the server is shutting down")
            if self._num_waiting >= self.max_waiting:
                raise Overloaded(f"{self._num_waiting} requests are already waiting to be scheduled "
                                 f"(max_waiting_requests = {self.max_waiting})")
            self._num_waiting += 1
        handle = Handle(uuid.uuid4().hex)
        self._commands.put(("add", (handle, prompt, params)))
        return handle

    def abort(self, handle: Handle) -> None:
        """Stop a request whose client has gone; its blocks and state slot are freed by the next loop."""
        self._commands.put(("abort", handle))

    def stats(self, timeout: float = 10.0) -> dict:
        """``engine.stats()`` taken between two steps (TimeoutError if the loop does not answer)."""
        if not self.alive:
            raise TimeoutError("the engine thread is not running")
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._commands.put(("stats", reply))
        try:
            return reply.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the engine thread did not answer within {timeout} s") from None

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            while self._take_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException:  # noqa: BLE001 -- the loop must not die silently with readers waiting
            traceback.print_exc(file=sys.stderr)
        finally:
            self._shutdown()

    def _take_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting for one if ``block``); False once told to stop."""
        while True:
            try:
                kind, arg = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*arg)
            elif kind == "abort":
                self._abort(arg)
            else:
                arg.put(self.engine.stats())

    def _add(self, handle: Handle, prompt: Prompt, params: SamplingParams) -> None:
        try:
            self.engine.add_prompt(prompt, params, request_id=handle.request_id)
        except (ValueError, TypeError) as e:  # this request's fault alone (the HTTP thread checked most already)
            self._scheduled(handle)
            field = getattr(e, "field", "prompt")  # the engine names the argument at fault
            handle.outputs.put(APIError(400, " ".join(str(e).split()), "max_tokens" if field == "max_tokens"
                                        else "messages" if prompt.media else "prompt"))
            return
        self._live[handle.request_id] = handle

    def _abort(self, handle: Handle) -> None:
        self._scheduled(handle)
        if self._live.pop(handle.request_id, None) is not None:
            self.engine.abort(handle.request_id)
            self.histograms.count("abort")

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # noqa: BLE001 -- fail the live requests, keep serving
            traceback.print_exc(file=sys.stderr)
            cause = " ".join(f"{type(e).__name__}: {e}".split())
            for rid in list(self._live):
                self._fail(rid, f"the engine step failed: {cause} (the server log has the traceback)")
            return
        for out in outs:
            handle = self._live.get(out.request_id)
            if handle is None:
                continue
            self._scheduled(handle)
            handle.outputs.put(out)
            if out.finished:
                del self._live[out.request_id]
                self.histograms.observe(out)

    def _fail(self, rid: str, message: str) -> None:
        handle = self._live.pop(rid)
        self._scheduled(handle)
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001 -- already gone, or the engine is in a bad way: the reader still hears
            pass
        self.histograms.count("error")
        handle.outputs.put(APIError(500, message, type="server_error", code="internal_error"))

    def _scheduled(self, handle: Handle) -> None:
        """``handle`` no longer waits to be scheduled (first step, refusal or abort)."""
        if handle.waiting:
            handle.waiting = False
            with self._lock:
                self._num_waiting -= 1

    def _shutdown(self) -> None:
        """Abort what is live and wake its readers; later submissions are refused."""
        with self._lock:
            self._stopping = True
        for rid, handle in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 -- closing anyway; the reader still gets SHUTDOWN
                pass
            handle.outputs.put(SHUTDOWN)
        self._live.clear()
        while True:  # requests submitted after the last loop: refuse them too
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                arg[0].outputs.put(SHUTDOWN)
            elif kind == "stats":
                arg.put(self.engine.stats())
