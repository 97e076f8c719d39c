"""HEAD on every GET route, and the names a request may give the served model."""

import http.client
import json

import pytest

import minidsa
from minidsa.server import start_server

openai = pytest.importorskip("openai")

TIMEOUT = 30
GET_ROUTES = ["/health", "/metrics", "/v1/models"]


@pytest.fixture(scope="module")
def model():
    return minidsa.load("default", progress=False)


@pytest.fixture(scope="module")
def server(model):
    with start_server(model, port=0, model_name="default") as srv:  # what `serve --checkpoint default` does
        yield srv


def exchange(conn, method, path, body=None):
    """(status, lower-cased headers, raw body bytes) of one request on an open connection."""
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    r = conn.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_answers_the_get_headers_without_a_body(server, path):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        get_status, get_headers, get_body = exchange(conn, "GET", path)
        status, headers, body = exchange(conn, "HEAD", path)
        # the same connection goes on: a body sent after HEAD's headers would be read as the next response
        after_status, _, after_body = exchange(conn, "GET", "/health")
    finally:
        conn.close()
    assert (get_status, status) == (200, 200) and body == b""
    assert headers["content-type"] == get_headers["content-type"]
    assert int(headers["content-length"]) > 0 and int(get_headers["content-length"]) == len(get_body)
    if path != "/metrics":  # /metrics' counters may move between the two requests
        assert headers["content-length"] == get_headers["content-length"]
    assert (after_status, json.loads(after_body)) == (200, {"status": "ok"})


def test_head_is_refused_where_get_is_and_never_carries_a_body(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        for path, want in (("/v1/completions", 405), ("/v1/nothing", 404)):
            status, headers, body = exchange(conn, "HEAD", path)
            assert (status, body) == (want, b""), path
            assert int(headers["content-length"]) > 0  # the error body GET would carry, measured, not sent
        status, headers, _ = exchange(conn, "POST", "/v1/models", {})
        assert status == 405 and headers["allow"] == "GET, HEAD"
        status, _, body = exchange(conn, "GET", "/health")  # the connection is still in step
    finally:
        conn.close()
    assert (status, json.loads(body)) == (200, {"status": "ok"})


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["default"]


@pytest.mark.parametrize("name", ["default", "tiny"])  # the served name, and the config's
def test_the_served_name_and_the_config_name_are_both_answered(client, name):
    r = client.completions.create(model=name, prompt="hello", max_tokens=3, temperature=0)
    assert r.model == name and r.usage.completion_tokens >= 1  # answered, echoing the name the client used
    chunks = list(client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True))
    assert chunks and {c.model for c in chunks} == {name}


def test_another_name_is_a_404_naming_what_is_served(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="hello", max_tokens=3)
    message = info.value.body["message"]
    assert "'gpt-4o'" in message and "'default'" in message and "'tiny'" in message, message


def test_without_a_name_the_server_serves_the_config_name(model):
    with start_server(model, port=0) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        assert c.completions.create(model="tiny", prompt="hi", max_tokens=2).model == "tiny"
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="default", prompt="hi", max_tokens=2)
