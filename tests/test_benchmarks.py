"""Every benchmark with a ``--dry-run`` mode still runs: tiny shapes on the CPU interpreter, checking the
logic and the agreement checks (a benchmark that only runs on the GPU would otherwise rot unseen, as
bench_moe.py once did after a rename)."""

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
