"""The serving benchmark fails loudly: a run in which a request did not reach its output length exits 1
and says how many and why, instead of an ordinary-looking report ("Successful requests: 0", exit 0)."""

import pytest

import minidsa
from minidsa.serving import bench

ARGV = ["bench", "--config", "default", "--num-requests", "3", "--input-len", "10", "30", "--output-len", "2", "4"]


def result_with(failures: dict, n: int = 4) -> dict:
    return {"num_requests": n, "failures": failures}


def test_failure_groups_the_reasons_commonest_first():
    assert bench.failure(result_with({})) is None
    text = bench.failure(result_with({"error: RuntimeError: x": 1, "abort": 2, "stop": 1}, n=10))
    lines = text.splitlines()
    assert lines[0].startswith("4 of 10 requests did not finish normally")
    assert lines[1:] == ["  1 x error: RuntimeError: x", "  2 x abort", "  1 x stop"]
    many = bench.failure(result_with({f"error: {i}": 5 - i for i in range(5)}, n=20), shown=2)
    assert many.splitlines()[1:] == ["  5 x error: 0", "  4 x error: 1", "  ... and 3 other reasons (6 requests)"]


@pytest.fixture
def nan_model(monkeypatch):
    """`python -m minidsa bench` loading a model whose logits are all NaN (the GPU fault that was reported)."""
    from minidsa import cli
    model = minidsa.load("default", progress=False)
    head = model.language_model.lm_head  # the logits of every path (engine steps, graphs, generate)
    forward = head.forward
    monkeypatch.setattr(head, "forward", lambda *a, **kw: forward(*a, **kw).fill_(float("nan")))
    monkeypatch.setattr(cli, "load", lambda *a, **kw: model)
    return model


def test_the_cli_exits_1_and_says_why_when_requests_fail(nan_model, capsys):
    from minidsa.cli import main
    assert main(ARGV) == 1
    out, err = capsys.readouterr()
    assert "Successful requests:                             0" in out
    assert "Failed requests:                                 3" in out
    assert "Sequential" not in out  # no baseline to compare a failed run with
    assert err.startswith("FAILED: 3 of 3 requests did not finish normally")
    assert "3 x error: the logits of this request's last position hold NaN or inf" in err


def test_the_cli_exits_0_when_every_request_reaches_its_length(capsys):
    from minidsa.cli import main
    assert main(ARGV + ["--no-sequential"]) == 0
    out, err = capsys.readouterr()
    assert "Successful requests:                             3" in out and "Failed requests:" in out
    assert "FAILED" not in err
    startup = next(line for line in out.splitlines() if line.startswith("Engine start-up, warm-up included (s):"))
    assert float(startup.split()[-1]) >= 0  # a number of seconds (a tiny model starts in under 5 ms)
