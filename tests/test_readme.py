"""The README's usage example runs as written."""

import inspect
import re
from pathlib import Path

import pytest

import minidsa
from minidsa.server import start_server

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert isinstance(namespace["text"], str) and len(namespace["texts"]) == 2
    assert namespace["text"].trace.selected and namespace["tr"].depth_weights


def test_readme_shipped_model_example_prints_what_its_comments_say(capsys):
    """The second example: the shipped checkpoint answers the pass-key prompt and names the drawn shape,
    printing what the example's comments promise (one line per print)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "pass key" in b)
    want = re.findall(r"print\(.*\)\s+# (.+)", example)
    assert len(want) == 2, want
    exec(compile(example, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip().splitlines() == want


def test_readme_engine_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "minidsa.Engine(" in b)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    outs = namespace["outs"]
    assert [o.finished for o in outs] == [True, True] and all(o.token_ids for o in outs)
    lines = capsys.readouterr().out.strip().splitlines()
    # the last step finishes it; no preemption; the repeated prompt's first 128 tokens come from the prefix cache
    assert lines[-2].split()[1] == "True" and lines[-1] == "0 128"
    assert all(line.split()[1] == "False" for line in lines[:-2])


def test_readme_generate_signature_is_the_real_one():
    """The one-line signature in the README names every parameter of minidsa.generate, in order, with the
    defaults it states."""
    text = " ".join(README.read_text().split())
    line = re.search(r"`generate\((.*?)\)` takes", text).group(1)
    line = re.sub(r"\s*\([^)]*\)", "", line)  # the inline notes, e.g. "(0 = greedy)"
    stated = [p.strip() for p in line.split(",") if p.strip() != "*"]
    params = {name: p for name, p in inspect.signature(minidsa.generate).parameters.items()
              if p.kind != p.VAR_KEYWORD}  # **deprecated: the old flags, kept working for one release
    assert [p.split("=")[0] for p in stated] == list(params), stated
    for p in stated:
        if "=" in p:
            name, value = p.split("=")
            assert repr(params[name].default) == value, (name, value, params[name].default)


def test_readme_openai_client_line_works_against_the_server(monkeypatch):
    """The README's ``OpenAI(...)`` call, pointed at a server on a free port, answers: the openai client
    refuses to start without a key (unless the environment holds one), so the line must carry one."""
    openai = pytest.importorskip("openai")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    call = re.search(r"`OpenAI\((.*?)\)`", " ".join(README.read_text().split())).group(1)
    kwargs = eval(f"dict({call})")  # noqa: S307 -- the README's own literal keyword arguments
    assert kwargs["base_url"] == "http://127.0.0.1:8000/v1" and kwargs.get("api_key"), kwargs
    with start_server(minidsa.load("default", progress=False), port=0) as server:
        kwargs["base_url"] = server.url + "/v1"
        client = openai.OpenAI(**kwargs, timeout=30, max_retries=0)
        r = client.completions.create(model=server.model_name, prompt="hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2 or r.choices[0].finish_reason == "stop"
