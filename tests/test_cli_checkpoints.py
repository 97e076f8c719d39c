"""How the CLI, run as a user runs it, takes a checkpoint argument: "default" everywhere, and a directory that
is not there reported as a missing directory (not as a missing config file), naming the value and the fix."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import minidsa

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = minidsa.checkpoint.PRETRAINED["default"]


def run(*argv, cwd=ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "minidsa", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow  # two processes
def test_check_checkpoint_takes_default():
    by_name = run("check-checkpoint", "default", "--no-progress")
    by_path = run("check-checkpoint", str(SHIPPED), "--no-progress")
    assert by_name.returncode == 0 == by_path.returncode, by_name.stderr
    # the same report as for the shipped directory's own path, timing aside
    strip = lambda text: [line.split(" read in ")[0] for line in text.splitlines()]  # noqa: E731
    assert strip(by_name.stdout) == strip(by_path.stdout) and str(SHIPPED) in by_name.stdout


MISSING_DIR = {  # command, its argv with the missing directory in place of {}
    "serve": ["serve", "--checkpoint", "{}", "--port", "0"],
    "doctor": ["doctor", "--checkpoint", "{}"],
    "generate": ["generate", "hi", "--config", "{}", "--no-progress"],
    "check-checkpoint": ["check-checkpoint", "{}", "--no-progress"],
    "eval": ["eval", "--checkpoint", "{}", "--n", "1"],
}


@pytest.mark.parametrize("command", [c if c == "generate" else pytest.param(c, marks=pytest.mark.slow)  # a process each
                                     for c in MISSING_DIR])
def test_a_missing_checkpoint_directory_is_named_as_a_directory(tmp_path, command):
    missing = str(tmp_path / "no" / "such" / "dir")
    r = run(*[missing if a == "{}" else a for a in MISSING_DIR[command]])
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert r.stderr.count("\n") == 1 and line.startswith("error: "), r.stderr  # one line, no traceback
    assert f"directory {missing!r} does not exist" in line and "config file" not in line, line
    assert "'default'" in line, line  # and what would have worked


@pytest.mark.slow  # a process each
def test_a_name_that_is_neither_a_directory_nor_a_preset_lists_the_presets(tmp_path):
    r = run("eval", "--checkpoint", "no-such-model", "--n", "1", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "'no-such-model'" in r.stderr and all(p in r.stderr for p in minidsa.preset_names() + ["'default'"])


@pytest.mark.slow
def test_check_checkpoint_of_a_preset_says_there_are_no_files_and_how_to_get_some(tmp_path):
    r = run("check-checkpoint", "tiny", "--no-progress", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "'tiny' is a preset" in r.stderr and "save_pretrained" in r.stderr, r.stderr
