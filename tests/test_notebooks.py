"""Every notebook runs as shipped, top to bottom (with a non-interactive backend, its code unchanged), within the
time a reader is promised; the committed notebooks are the executed ones (`python notebooks/build.py`); and what
they store shows a reader no warning, no path of the machine that built them and no mangled markdown."""

import hashlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

import matplotlib
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
MAX_SECONDS = 180  # "well under 3 minutes" on 2 shared cores with one thread (00-07 aim for under 60 s)
# 08 trains a model: 600 optimizer steps at 2-6 steps/s on one thread of a 2-core machine, plus its evaluations
# (it promises "two to six minutes"; slow shared 2-core machines have taken 285-315 s)
TRAINING_MAX_SECONDS = {"08_train_it_yourself.ipynb": 480}
# What notebooks/build.py refuses to store: paths of the machine that built a notebook (a reader has other ones),
# warnings, and control characters in a cell (a LaTeX "\frac" passed through a Python string becomes a form feed)
MACHINE_PATH = re.compile(r"(?<![\w.$~-])(/(work|home|root|tmp|Users|private|var/folders)/|[A-Za-z]:\\Users\\)")
WARNING = re.compile(r"\w*Warning\b")
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")  # every control character but the newline


def text(value) -> str:
    return value if isinstance(value, str) else "".join(value)


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.slow  # every cell of every notebook, plots included: a tour of the whole package per notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    """... exactly as a reader runs it, in under MAX_SECONDS, and leaves nothing in the temp folder (a notebook
    that saves a checkpoint must do it in a TemporaryDirectory)."""
    import torch._dynamo  # noqa: F401  (its first import creates torch's own cache folder in the temp folder)
    before = set(os.listdir(tempfile.gettempdir()))
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = code_cells(json.loads(path.read_text()))
    assert cells
    namespace: dict = {}
    start = time.perf_counter()
    for i, cell in enumerate(cells):
        exec(compile(text(cell["source"]), f"{path.name}[cell {i}]", "exec"), namespace)
        plt.close("all")  # a figure per cell, not all of them at once
    elapsed = time.perf_counter() - start
    limit = TRAINING_MAX_SECONDS.get(path.name, MAX_SECONDS)
    print(f"{path.name}: {elapsed:.1f} s")
    assert elapsed < limit, f"{path.name} took {elapsed:.0f} s; it must finish in under {limit} s"
    assert "model" in namespace
    assert set(os.listdir(tempfile.gettempdir())) <= before


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_executed(path):
    """nbformat 4.5 with a unique id per cell, every code cell executed once, top to bottom in one kernel, with
    the code it holds now: what notebooks/build.py writes, so a reader on GitHub sees every output and picture of
    the code in front of them without running anything."""
    nb = json.loads(path.read_text())
    rebuild = f"run python notebooks/build.py {path.name[:2]}"
    assert (nb["nbformat"], nb["nbformat_minor"]) == (4, 5), f"{path.name}: {rebuild}"
    ids = [c.get("id") for c in nb["cells"]]
    assert all(ids) and len(set(ids)) == len(ids), f"{path.name}: cells without a unique id"
    code = code_cells(nb)
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: cells not executed in one run from the top; {rebuild}"
    assert any(c.get("outputs") for c in code), f"{path.name}: no outputs stored"
    digest = hashlib.sha256("".join(text(c["source"]) + "\0" for c in code).encode()).hexdigest()
    assert nb["metadata"].get("executed_code_sha256") == digest, \
        f"{path.name}: its code changed since its outputs were stored; {rebuild}"


def output_text(out: dict) -> str:
    parts = [text(out.get("text", "")), text(out.get("traceback", []))]
    parts += [str(v) if k.endswith("json") else text(v) for k, v in out.get("data", {}).items()
              if k.startswith("text/") or k.endswith("json")]
    return "\n".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_shows_no_warning_path_or_control_character(path):
    """Stored outputs hold nothing written to stderr, no warning, no error and no absolute path of the machine
    that ran them; no cell (markdown above all, where LaTeX lives) holds a TAB, a form feed or another control
    character."""
    bad = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if CONTROL.search(text(cell["source"])):
            bad.append(f"cell {i} ({cell['cell_type']}): control character "
                       f"{CONTROL.search(text(cell['source']))[0]!r} in its source")
        for out in cell.get("outputs", []):
            shown = output_text(out)
            if out["output_type"] == "stream" and out["name"] == "stderr" or out["output_type"] == "error":
                bad.append(f"cell {i}: {out['output_type']} {out.get('name', '')}: {shown[:120]!r}")
            for pattern in (WARNING, MACHINE_PATH):
                if pattern.search(shown):
                    bad.append(f"cell {i}: output shows {pattern.search(shown)[0]!r}")
    assert not bad, f"{path.name}:\n" + "\n".join(bad)


def test_there_are_notebooks():
    assert NOTEBOOKS
