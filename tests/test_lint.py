"""``ruff check`` over the package, the tests, the benchmarks and the notebooks: the rules of pyproject.toml's
[tool.ruff] hold for every file in the repository, not only for the files someone remembered to lint."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["minidsa", "tests", "benchmarks", "notebooks"]


def test_ruff_check_is_clean():
    pytest.importorskip("ruff", reason="ruff is not installed; pip install -e '.[test]' brings it")
    # --no-cache: a test run writes nothing into the checkout; concise: one line per finding, file:line:column
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *TARGETS],
                         cwd=ROOT, capture_output=True, text=True)
    code, output = run.returncode, run.stdout + run.stderr
    assert code == 0, f"ruff check {' '.join(TARGETS)} exited {code}:\n{output}"
