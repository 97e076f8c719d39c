"""The HTTP service on 127.0.0.1, driven by the client its users call it with (the openai package) and by raw
HTTP for what a client library would refuse to send.

Expected outputs come from an independent ``Engine`` on the same shipped model (greedy, or seeded
sampling), never from the server's code. Every client call has a timeout, so a hung server fails a test
instead of hanging the run.
"""

import base64
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

import minidsa
from minidsa import Engine, SamplingParams
from minidsa.server import start_server
from minidsa.server.chat import render
from minidsa.tokenizer import IMAGE_MARKER

openai = pytest.importorskip("openai")
prom_parser = pytest.importorskip("prometheus_client.parser")

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 30
QUESTION = "colour and shape?"
PROMPTS = ["the river runs past old town where people walk slowly The pass key of kqz is 40271. birds sing\n"
           "Q: pass key of kqz?\nA: ", "hello world, "]


@pytest.fixture(scope="module")
def model():
    return minidsa.load("default", progress=False)


@pytest.fixture(scope="module")
def server(model):
    with start_server(model, port=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def complete(server, client):
    """client.completions.create for the served model (the openai client insists on a model)."""
    return lambda **kw: client.completions.create(model=server.model_name, **kw)


@pytest.fixture(scope="module")
def chat(server, client):
    return lambda **kw: client.chat.completions.create(model=server.model_name, **kw)


def engine_outputs(model, prompts, params, images=None):
    return Engine(model).generate(prompts, params, images=images, progress=False)


def greedy(model, prompts, n, images=None):
    return engine_outputs(model, prompts, SamplingParams(temperature=0, max_tokens=n), images)


def triangle() -> Image.Image:
    image = Image.new("RGB", (56, 56), (20, 20, 30))  # the README's drawn shape
    ImageDraw.Draw(image).polygon([(28, 12), (12, 44), (44, 44)], fill=(40, 190, 60))
    return image


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def request(server, method, path, body=None, timeout=TIMEOUT):
    """(status, headers, parsed JSON or text) of one raw HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read().decode()
        is_json = r.getheader("Content-Type", "").startswith("application/json")
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(raw) if is_json else raw
    finally:
        conn.close()


def metrics(server) -> dict:
    """/metrics parsed by Prometheus' own parser: {(sample name, frozen labels minus model_name): value}."""
    status, headers, text = request(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for family in prom_parser.text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            assert s.labels["model_name"] == server.model_name
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def gauge(server, name) -> float:
    return metrics(server)[("minidsa:" + name, ())]


def open_stream(server, body) -> socket.socket:
    """A raw socket that has sent one POST /v1/completions with ``body``."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def read_until(sock, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        piece = sock.recv(65536)
        assert piece, f"connection closed before {marker!r}; got {buf[-300:]!r}"
        buf += piece
    return buf


def wait_for(condition, what: str, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------- completions
def test_completion_equals_the_engine(model, server, complete):
    expected = greedy(model, PROMPTS, 12)
    for prompt, exp in zip(PROMPTS, expected):
        r = complete(prompt=prompt, max_tokens=12, temperature=0)
        assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == server.model_name
        assert r.choices[0].text == exp.text and r.choices[0].finish_reason == exp.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(exp.prompt_token_ids), len(exp.token_ids))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "40271" in expected[0].text  # the shipped model retrieves the pass key: the comparison means something


def test_streamed_completion_equals_the_engine(model, server, complete):
    exp = greedy(model, PROMPTS[:1], 12)[0]
    chunks = list(complete(prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len(chunks) > 3  # token by token, not one lump
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == exp.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == exp.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(exp.token_ids)


def test_seeded_sampling_is_reproducible_and_equals_the_engine(model, server, complete):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    exp = engine_outputs(model, ["once upon a time"], params)[0]
    texts = [complete(prompt="once upon a time", max_tokens=16, temperature=1.0, top_p=0.9,
                                       seed=1234).choices[0].text for _ in range(2)]
    assert texts == [exp.text, exp.text]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text(model, server, stream, complete):
    full = greedy(model, PROMPTS[1:], 24)[0].text
    assert len(full) >= 8, full
    stop = full[4:6]
    cut = full.find(stop)
    r = complete(prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop, "\x00never"],
                                  stream=stream)
    if stream:
        chunks = list(r)
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (text, reason) == (full[:cut], "stop")


# ---------------------------------------------------------------------------------------------- chat
def test_chat_with_an_image_equals_the_engine(model, server, chat):
    arr = np.asarray(triangle())
    prompt = f"{IMAGE_MARKER}\nQ: {QUESTION}\nA: "
    exp = greedy(model, [prompt], 16, images=[[arr]])[0]
    assert "green triangle" in exp.text
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(triangle())}},
                                             {"type": "text", "text": QUESTION}]}]
    r = chat(messages=messages, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == exp.text
    assert r.choices[0].finish_reason == exp.finish_reason
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)  # the image's tokens counted

    chunks = list(chat(messages=messages, temperature=0, stream=True))  # no max_tokens
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == exp.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_request_is_encoded_once(model, server, chat, monkeypatch):
    """The HTTP thread encodes the prompt and preprocesses its image to check the length, and the engine queues
    that encoding as it is: one tokenization and one preprocessing per request, not one more in the engine."""
    from minidsa.serving import requests

    counts = {"encode": 0, "preprocess": 0}
    encode, preprocess = model.tokenizer.encode, requests.preprocess

    def counted(name, f):
        def wrapper(*a, **kw):
            counts[name] += 1
            return f(*a, **kw)
        return wrapper
    monkeypatch.setattr(model.tokenizer, "encode", counted("encode", encode))
    monkeypatch.setattr(requests, "preprocess", counted("preprocess", preprocess))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(triangle())}},
                                             {"type": "text", "text": QUESTION}]}]
    assert "green triangle" in chat(messages=messages, max_tokens=16, temperature=0).choices[0].message.content
    assert counts == {"encode": 1, "preprocess": 1}


def test_chat_template_is_the_training_format():
    image = data_url(triangle())
    prompt, images = render([
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "image_url", "image_url": {"url": image}},
                                     {"type": "text", "text": "colour?"}, {"type": "image_url", "image_url": image}]},
        {"role": "assistant", "content": "green"},
        {"role": "user", "content": "and the shape?"}])
    assert prompt == (f"Answer briefly.\n{IMAGE_MARKER}\n{IMAGE_MARKER}\nQ: first\ncolour?\nA: green\n"
                      f"Q: and the shape?\nA: ")
    assert len(images) == 2 and images[0].shape == (56, 56, 3) and images[0].dtype == np.uint8
    assert (images[0] == np.asarray(triangle())).all()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.model_name]
    status, _, body = request(server, "GET", "/health")
    assert (status, body) == (200, {"status": "ok"})


def test_a_request_without_model_gets_the_served_one(model, server):
    status, _, reply = request(server, "POST", "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 4,
                                                                   "temperature": 0})
    assert status == 200 and reply["model"] == server.model_name
    assert reply["choices"][0]["text"] == greedy(model, PROMPTS[1:], 4)[0].text


# --------------------------------------------------------------------------------------------- errors
LONG = "x" * 300  # more bytes than the shipped model's 256-token context
BAD = {
    "malformed JSON": ("/v1/completions", b'{"prompt": "hi",', 400, None, "JSON"),
    "max_tokens a string": ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    "max_tokens zero": ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    "temperature a string": ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    "temperature negative": ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", ">= 0"),
    "top_p out of range": ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    "top_p a bool": ("/v1/completions", {"prompt": "hi", "top_p": True}, 400, "top_p", "number"),
    "stop a number": ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop", "string"),
    "n two": ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n", "not supported"),
    "prompt missing": ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "string"),
    "stream_options without stream": ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
                                      400, "stream_options", "stream"),
    "unknown model": ("/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, 404, "model", "does not exist"),
    "prompt too long": ("/v1/completions", {"prompt": LONG}, 400, "prompt", "context"),
    "max_tokens past the context": ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens",
                                    "max_tokens <= 253"),
    "chat prompt too long": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400,
                             "messages", "context"),
    "messages missing": ("/v1/chat/completions", {"model": None}, 400, "messages", "non-empty list"),
    "bad role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0]",
                 "role"),
    "remote image URL": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, 400,
        "messages[0].content[0].image_url", "data URL"),
    "undecodable image": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]}, 400,
        "messages[0].content[0].image_url", "not an image"),
    "special token in chat text": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a <|eos|> b"}]},
                                   400, "messages[0].content", "special token string '<|eos|>'"),
    "a misspelt field": ("/v1/completions", {"prompt": "hi", "max_token": 2}, 400, "max_token",
                         "max_token: did you mean max_tokens?"),
    "a misspelt chat field": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "temprature": 0}, 400, "temprature", "did you mean temperature"),
    "a field of the other endpoint": ("/v1/completions", {"prompt": "hi", "messages": []}, 400, "messages",
                                      "messages is a field of /v1/chat/completions"),
    "an engine option vLLM has": ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1.1}, 400,
                                  "repetition_penalty", "unrecognized request argument supplied: repetition_penalty"),
    "tool_choice required": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "tool_choice": "required"}, 400, "tool_choice", "not supported"),
    # an unknown field is named before the images are decoded (this one is not an image at all)
    "unknown field beside an image": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}], "max_token": 2}, 400,
        "max_token", "unrecognized"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_requests_get_an_openai_error_naming_the_field(server, case):
    path, body, status, param, words = BAD[case]
    got, _, reply = request(server, "POST", path, body)
    assert got == status, reply
    err = reply["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"
    if case == "unknown model":
        assert err["code"] == "model_not_found"


def test_unknown_route_and_wrong_method(server):
    status, _, reply = request(server, "GET", "/v1/nothing")
    assert status == 404 and "/v1/completions" in reply["error"]["message"]
    status, headers, reply = request(server, "GET", "/v1/chat/completions")
    assert status == 405 and headers["allow"] == "POST" and reply["error"]["code"] == "method_not_allowed"
    status, headers, _ = request(server, "DELETE", "/v1/models")
    assert status == 405 and headers["allow"] == "GET, HEAD"


def test_openai_client_raises_on_errors(server, client, complete):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        complete(prompt="hi", max_tokens=1000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another", prompt="hi")


@pytest.mark.parametrize("stream", [False, True])
def test_a_misspelt_field_is_a_400_naming_it_through_the_client(server, complete, chat, stream):
    # max_token for max_tokens: ignored, it would have generated the default 16 tokens without a word
    hi = [{"role": "user", "content": "hi"}]
    for call in (lambda: complete(prompt="hi", stream=stream, extra_body={"max_token": 2}),
                 lambda: chat(messages=hi, stream=stream, extra_body={"max_token": 2})):
        with pytest.raises(openai.BadRequestError, match="max_token: did you mean max_tokens") as e:
            call()
        assert e.value.body["param"] == "max_token" and e.value.body["type"] == "invalid_request_error"


def test_fields_clients_send_are_read_or_knowingly_ignored(model, server, complete, chat):
    """user and the other IGNORED fields, OpenAI's defaults of what the server refuses otherwise, and vLLM's
    top_k and ignore_eos: accepted, and the answer is the one without them."""
    exp = greedy(model, PROMPTS[1:], 6)[0]
    r = complete(prompt=PROMPTS[1], max_tokens=6, temperature=0, user="alice", n=1, best_of=1, echo=False,
                 presence_penalty=0, frequency_penalty=0, seed=7, top_p=1, stop=["\x00never"],
                 extra_body={"top_k": 0, "ignore_eos": False, "safety_identifier": "a1", "service_tier": "auto"})
    assert r.choices[0].text == exp.text
    chunks = list(chat(messages=[{"role": "user", "content": PROMPTS[1]}], max_completion_tokens=6, temperature=0,
                       user="alice", metadata={"run": "test"}, store=False, parallel_tool_calls=False,
                       tool_choice="none", logprobs=False, n=1, seed=7, stream=True,
                       stream_options={"include_usage": True}, extra_body={"prompt_cache_key": "k"}))
    assert chunks[-1].usage.completion_tokens >= 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat(messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=6, temperature=0).choices[0].message.content


# ------------------------------------------------------------------------------ disconnects and overload
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_request(server, stream, complete):
    before = gauge(server, "generation_tokens_total")
    sock = open_stream(server, {"prompt": "", "max_tokens": 250, "ignore_eos": True, "temperature": 0,
                                "stream": stream})
    if stream:
        assert b"data: {" in read_until(sock, b"data: {")
    else:
        wait_for(lambda: gauge(server, "num_requests_running") == 1, "the request to run")
    assert gauge(server, "kv_cache_usage_perc") > 0 and gauge(server, "kda_state_usage_perc") > 0
    sock.close()
    wait_for(lambda: (gauge(server, "num_requests_running"), gauge(server, "kv_cache_usage_perc"),
                      gauge(server, "kda_state_usage_perc")) == (0, 0, 0), "the blocks and state slot to be freed")
    assert gauge(server, "generation_tokens_total") - before < 250  # aborted, not run to its end
    assert complete(prompt="hi", max_tokens=2).usage.completion_tokens == 2  # still serving


def test_overload_is_a_503_with_retry_after_and_close_ends_live_requests(model):
    base = {"prompt": "", "max_tokens": 250, "ignore_eos": True, "stream": True}
    before = {t.name for t in threading.enumerate()}
    srv = start_server(model, port=0, max_num_seqs=1, max_waiting_requests=1)
    try:
        running = open_stream(srv, base)
        read_until(running, b"data: {")  # scheduled: it no longer waits
        waiting = open_stream(srv, base)
        wait_for(lambda: gauge(srv, "num_requests_waiting") == 1, "the second request to wait")
        status, headers, reply = request(srv, "POST", "/v1/completions", {"prompt": "hi"})
        assert status == 503 and headers["retry-after"] == "1", reply
        assert reply["error"]["type"] == "server_error" and "max_waiting_requests = 1" in reply["error"]["message"]
        srv.close()  # with both still live
        assert b'"shutting_down"' in read_until(running, b"data: [DONE]")  # the stream ends with an error event
        assert read_until(waiting, b"\r\n\r\n").startswith(b"HTTP/1.1 503")
        running.close()
        waiting.close()
    finally:
        srv.close()
    srv.close()  # idempotent
    assert not srv.worker.alive
    wait_for(lambda: {t.name for t in threading.enumerate() if t.is_alive()} <= before, "the server's threads to end",
             timeout=5)


def test_an_engine_failure_is_a_500_never_a_success():
    broken = minidsa.load("default", progress=False)  # its own model: the forward is patched to fail
    with start_server(broken, port=0) as srv:
        decoder = broken.language_model.model  # what every engine step runs, packed or graphed
        decoder.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected failure"))
        for stream in (False, True):
            status, _, reply = request(srv, "POST", "/v1/completions", {"prompt": "hi", "stream": stream})
            assert status == 500 and "injected failure" in reply["error"]["message"], reply
            assert reply["error"]["type"] == "server_error"
        del decoder.forward
        status, _, reply = request(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and reply["usage"]["completion_tokens"] == 2  # the engine went on
        assert metrics(srv)[("minidsa:request_success_total", (("finished_reason", "error"),))] == 2


# -------------------------------------------------------------------------------------------- metrics
def test_metrics_parse_as_prometheus_text_and_move(server, complete):
    before = metrics(server)
    r = complete(prompt="hello", max_tokens=5, temperature=0)
    after = metrics(server)
    key = lambda name, **labels: ("minidsa:" + name, tuple(sorted(labels.items())))  # noqa: E731
    assert after[key("generation_tokens_total")] - before[key("generation_tokens_total")] == r.usage.completion_tokens
    assert after[key("prompt_tokens_total")] > before[key("prompt_tokens_total")]
    reason = r.choices[0].finish_reason
    assert after[key("request_success_total", finished_reason=reason)] == \
        before.get(key("request_success_total", finished_reason=reason), 0) + 1
    n = key("time_to_first_token_seconds_count")
    assert after[n] == before[n] + 1 and after[key("time_to_first_token_seconds_bucket", le="+Inf")] == after[n]
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kda_state_usage_perc",
                 "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "time_per_output_token_seconds_sum", "e2e_request_latency_seconds_count"):
        assert key(name) in after, name


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_serve_prints_where_it_listens():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "minidsa", "serve", "--port", "0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        # served under the --checkpoint value the user gave (here its default), as vLLM does
        assert line.startswith("serving default at http://127.0.0.1:"), line + proc.stderr.read() if not line else line
        url = line.split()[3]
        host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=TIMEOUT)
