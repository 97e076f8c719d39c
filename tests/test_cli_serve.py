"""``python -m minidsa serve`` as a user starts it: the model answers to the name it was started with."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import minidsa

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 30


@contextlib.contextmanager
def serving(*args, cwd=ROOT, stop=signal.SIGINT):
    """(the name the start line announces, an openai client) of a fresh ``serve`` process on a free port;
    Ctrl-C (or ``stop``) ends it, which must exit 0."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # A run started in the background (`cmd &`) ignores SIGINT, and so would a child it starts: Python then gives
    # it no KeyboardInterrupt and Ctrl-C would never reach serve. A user's Ctrl-C comes from a terminal.
    proc = subprocess.Popen([sys.executable, "-m", "minidsa", "serve", "--port", "0", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving "), line or proc.communicate(timeout=TIMEOUT)[1]
        words = line.split()
        name, url = " ".join(words[1:words.index("at")]), words[words.index("at") + 1]
        yield name, openai.OpenAI(base_url=url, api_key="unused", timeout=TIMEOUT, max_retries=0)
    finally:
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err


def answers_to(client, name) -> bool:
    try:
        r = client.completions.create(model=name, prompt="hello", max_tokens=2, temperature=0)
    except openai.NotFoundError:
        return False
    assert r.model == name and r.usage.completion_tokens >= 1
    return True


def test_serve_default_answers_to_default_and_to_the_config_name():
    with serving("--checkpoint", "default") as (announced, client):
        assert announced == "default"
        assert [m.id for m in client.models.list().data] == ["default"]
        assert answers_to(client, "default") and answers_to(client, "tiny")
        assert not answers_to(client, "laptop")


@pytest.mark.slow  # a server process each
def test_serve_a_directory_answers_to_its_path_as_typed(tmp_path):
    minidsa.load("tiny").save_pretrained(tmp_path / "runs" / "mine")
    with serving("--checkpoint", "runs/mine", cwd=tmp_path) as (announced, client):
        assert announced == "runs/mine"
        assert [m.id for m in client.models.list().data] == ["runs/mine"]
        assert answers_to(client, "runs/mine") and answers_to(client, "tiny")


@pytest.mark.slow
def test_served_model_name_replaces_the_checkpoint_value():
    with serving("--checkpoint", "default", "--served-model-name", "my-model") as (announced, client):
        assert announced == "my-model"
        assert [m.id for m in client.models.list().data] == ["my-model"]
        assert answers_to(client, "my-model") and not answers_to(client, "default")


def test_sigterm_stops_serve_as_ctrl_c_does():
    """A service manager (systemd, Kubernetes) or ``kill`` sends SIGTERM: serve closes and exits 0, as on Ctrl-C."""
    with serving(stop=signal.SIGTERM) as (name, client):
        assert answers_to(client, name)
