"""Every notebook's code cells run top to bottom (on the tiny config, with a non-interactive backend)."""

import json
import os
import tempfile
from pathlib import Path

import matplotlib
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow  # every cell of every notebook, plots included: a tour of the whole package per notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    """... and leaves nothing in the temp folder (notebook 02 once left a 56 MB checkpoint per run)."""
    import torch._dynamo  # noqa: F401  (its first import creates torch's own cache folder in the temp folder)
    before = set(os.listdir(tempfile.gettempdir()))
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells
    namespace: dict = {}
    for i, cell in enumerate(cells):
        src = "".join(cell["source"]).replace('CONFIG = "laptop"', 'CONFIG = "tiny"')
        exec(compile(src, f"{path.name}[cell {i}]", "exec"), namespace)
    plt.close("all")
    assert "model" in namespace
    assert set(os.listdir(tempfile.gettempdir())) <= before


def test_there_are_notebooks():
    assert NOTEBOOKS
