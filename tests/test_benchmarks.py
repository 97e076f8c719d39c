"""Every benchmark with a ``--dry-run`` mode still runs: tiny shapes on the CPU interpreter, checking the
logic and the agreement checks (a benchmark that only runs on the GPU would otherwise rot unseen, as
bench_moe.py once did after a rename)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("bench_*.py") if "--dry-run" in p.read_text())


def test_there_are_benchmarks_to_check():
    assert len(SCRIPTS) >= 5, [p.name for p in SCRIPTS]


@pytest.mark.slow  # each script is a fresh process that compiles and interprets every kernel it times: minutes in all
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_benchmark_dry_run(script):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("OUT", None)  # results files only on the GPU machine
    run = subprocess.run([sys.executable, str(script), "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "PASS" in run.stdout and "FAIL" not in run.stdout, run.stdout[-2000:]


def test_bench_serving_exits_1_when_requests_fail(monkeypatch, capsys):
    """A run whose every request failed once printed an ordinary report and exited 0."""
    import minidsa
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "benchmarks" / "bench_serving.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = minidsa.load("default", progress=False)
    head = model.language_model.lm_head  # the logits of every path (engine steps, graphs, generate)
    forward = head.forward
    monkeypatch.setattr(head, "forward", lambda *a, **kw: forward(*a, **kw).fill_(float("nan")))
    monkeypatch.setattr(minidsa, "load", lambda *a, **kw: model)
    monkeypatch.setattr(sys, "argv", ["bench_serving.py", "--config", "default", "--num-requests", "2", "--input-len",
                                      "10", "20", "--output-len", "2", "3", "--sequential-requests", "0"])
    with pytest.raises(SystemExit) as e:
        script.main()
    assert e.value.code == 1
    assert "FAILED: 2 of 2 requests did not finish normally" in capsys.readouterr().err
