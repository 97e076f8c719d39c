"""A request the engine fails is never answered as a success: a 500 whose OpenAI error body names the cause,
plain or (once tokens have gone out) as the stream's last event, and the server goes on serving.

The failure is injected through the decoder's forward, the seam every engine step goes through (a packed
step or a graph): the served model is its own instance whose decoder raises or returns NaN while ``fault``
says so. Expected answers come from an independent Engine on an unpatched copy of the shipped model.
"""

import http.client
import json
import threading

import pytest

import minidsa
from minidsa import Engine, SamplingParams
from minidsa.cache import StepContext
from minidsa.server import start_server

openai = pytest.importorskip("openai")

TIMEOUT = 30
PROMPT = "hello world, "
CAUSE = "injected fault: the accelerator went away"


@pytest.fixture(scope="module")
def reference():
    return minidsa.load("default", progress=False)


@pytest.fixture(scope="module")
def faulty():
    """(server, fault): ``fault["mode"]`` None (healthy), "all" (every forward raises), "decode" (forwards of
    one token a row raise, so the prompt's prefill and first token pass) or "nan" (logits all NaN). A
    failing decode first waits for ``fault["gate"]``, so a test can hold it until its first chunk is read."""
    model = minidsa.load("default", progress=False)
    fault = {"mode": None, "gate": threading.Event()}
    fault["gate"].set()
    decoder = model.language_model.model
    forward = decoder.forward

    def patched(emb, ctx, trace):
        mode = fault["mode"]
        decode = emb.shape[1] == 1 or (isinstance(ctx, StepContext) and ctx.prefill_rows == 0)
        if mode == "decode" and decode:
            fault["gate"].wait(TIMEOUT)
            raise RuntimeError(CAUSE)
        if mode == "all":
            raise RuntimeError(CAUSE)
        hidden = forward(emb, ctx, trace)
        return hidden * float("nan") if mode == "nan" else hidden

    decoder.forward = patched
    with start_server(model, port=0) as srv:
        yield srv, fault


@pytest.fixture
def client(faulty):
    srv, fault = faulty
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
    fault["mode"] = None
    fault["gate"].set()


def greedy(model, n):
    return Engine(model).generate([PROMPT], SamplingParams(temperature=0, max_tokens=n), progress=False)[0].text


def still_serving(srv, client, reference):
    """The next request gets the right answer, and the failed one left no KV blocks behind."""
    r = client.completions.create(model=srv.model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == greedy(reference, 8) and r.choices[0].finish_reason in ("stop", "length")
    assert srv.worker.stats()["kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("mode", ["all", "decode"])
def test_a_failed_completion_is_a_500_naming_the_cause(faulty, client, reference, mode):
    srv, fault = faulty
    fault["mode"] = mode
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=srv.model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    assert info.value.status_code == 500 and CAUSE in info.value.message, info.value
    assert info.value.body["type"] == "server_error"
    fault["mode"] = None
    still_serving(srv, client, reference)


def test_a_failed_chat_is_a_500_naming_the_cause(faulty, client, reference):
    srv, fault = faulty
    fault["mode"] = "decode"
    with pytest.raises(openai.InternalServerError, match=CAUSE):
        client.chat.completions.create(model=srv.model_name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8)
    fault["mode"] = None
    still_serving(srv, client, reference)


def test_a_stream_that_fails_before_its_first_token_is_a_plain_500(faulty, client, reference):
    srv, fault = faulty
    fault["mode"] = "all"
    with pytest.raises(openai.InternalServerError, match=CAUSE):
        client.completions.create(model=srv.model_name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    fault["mode"] = None
    still_serving(srv, client, reference)


def test_a_stream_that_fails_midway_ends_with_an_error_event(faulty, client, reference):
    srv, fault = faulty
    fault["mode"] = "decode"
    fault["gate"].clear()  # the decode fails only once the first token has been read
    stream = client.completions.create(model=srv.model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                       stream=True)
    chunks = iter(stream)
    received = [next(chunks)]
    fault["gate"].set()
    with pytest.raises(openai.APIError, match=CAUSE):
        for chunk in chunks:
            received.append(chunk)
    assert received and all(c.choices[0].finish_reason is None for c in received)  # never a clean finish
    assert greedy(reference, 8).startswith("".join(c.choices[0].text for c in received))
    fault["mode"] = None
    still_serving(srv, client, reference)


def test_a_failed_stream_reads_as_an_error_event_then_done_on_the_wire(faulty, client):
    """What a client without the openai package sees: the 200 stream's last data events."""
    srv, fault = faulty
    fault["mode"] = "decode"
    fault["gate"].clear()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 8, "stream": True}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        first = r.readline()  # the first token's event: the headers and a chunk are out
        fault["gate"].set()
        events = [e for e in (first + r.read()).decode().split("\n\n") if e]
    finally:
        conn.close()
    assert r.status == 200 and first.startswith(b"data: {") and events[-1] == "data: [DONE]", events
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert CAUSE in error["message"] and error["type"] == "server_error", error


def test_an_engine_step_that_raises_is_a_500_naming_the_cause(faulty, client, reference, monkeypatch):
    """A failure outside any request's forward (the worker's own guard): the cause still reaches the client."""
    srv, _ = faulty
    step = srv.engine.step

    def fail_once():
        monkeypatch.setattr(srv.engine, "step", step)
        raise RuntimeError("the scheduler lost a block")

    monkeypatch.setattr(srv.engine, "step", fail_once)
    with pytest.raises(openai.InternalServerError, match="the scheduler lost a block"):
        client.completions.create(model=srv.model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    still_serving(srv, client, reference)


def test_nan_logits_are_a_500_not_an_answer(faulty, client, reference):
    srv, fault = faulty
    fault["mode"] = "nan"
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=srv.model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    assert "NaN" in info.value.message, info.value
    fault["mode"] = None
    still_serving(srv, client, reference)
