"""Every option of every command says in its ``--help`` what it defaults to, as a user reads it."""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minidsa.cli import _parser

ROOT = Path(__file__).resolve().parents[1]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


COMMANDS = subcommands()


def option_blocks(help_text: str) -> dict[str, str]:
    """{first option string: its help, on one line} from the "options:" section of argparse's output."""
    section = help_text.split("\noptions:\n", 1)[1]
    blocks: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        m = re.match(r"  (-[-\w]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current is not None and line.startswith("    "):
            blocks[current] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in blocks.items()}


def test_every_command_is_checked():
    assert set(COMMANDS) >= {"generate", "params", "check-checkpoint", "train", "bench", "serve", "doctor", "eval"}


def help_text(command: str) -> str:
    """What ``python -m minidsa COMMAND --help`` prints: the same parser, formatted in this process (one fresh
    process per command costs seconds each; ``test_help_from_a_fresh_process`` checks that path once)."""
    return COMMANDS[command].format_help()


def test_help_from_a_fresh_process():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", COLUMNS="250")
    r = subprocess.run([sys.executable, "-m", "minidsa", "generate", "--help"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "(default: %(default)s" not in r.stdout, r.stderr
    assert option_blocks(r.stdout)["--temperature"] == "--temperature TEMPERATURE 0 = greedy (default: 0.8)"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_states_its_default(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # argparse wraps to the terminal: no wrapping inside values
    blocks = option_blocks(help_text(command))
    options = [a for a in COMMANDS[command]._actions if a.option_strings and a.dest != "help"]
    assert options and len(blocks) == len(options) + 1, blocks  # + -h
    for action in options:
        block = blocks[action.option_strings[0]]
        assert "(default: " in block or "; default: " in block, block
        value = action.default
        if value not in (None, False):  # a concrete default must be the one stated
            shown = " ".join(map(str, value)) if isinstance(value, list) else str(value)
            assert f"default: {shown}" in block, (block, value)
