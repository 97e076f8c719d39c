"""The names a user meets resolve: every ``minidsa.X`` and ``from minidsa... import Y`` in the README's and the
notebooks' code, and the package's own ``__all__`` lists. Moving a module must not break what they show."""

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

import minidsa
from minidsa import ops

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def user_code() -> list[tuple[str, str]]:
    """(where, source) of every python block of README.md and every code cell of the notebooks."""
    out = [(f"README.md block {i}", b) for i, b in
           enumerate(re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S))]
    for nb in NOTEBOOKS:
        cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        out += [(f"{nb.name} cell {i}", "".join(c["source"])) for i, c in enumerate(cells)]
    return out


def names_used(source: str) -> list[tuple[str, str]]:
    """(module, attribute) pairs: ``minidsa.a.b`` -> ("minidsa", "a"), ("minidsa.a", "b") when a is a module;
    ``from minidsa.x import y`` -> ("minidsa.x", "y"); ``import minidsa.x`` -> ("minidsa.x", "")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "minidsa":
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "minidsa"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "minidsa":
            found.append(("minidsa", node.attr))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                isinstance(node.value.value, ast.Name) and node.value.value.id == "minidsa":
            found.append(("minidsa." + node.value.attr, node.attr))
    return found


def resolves(module: str, attr: str) -> bool:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        parent, _, name = module.rpartition(".")   # minidsa.ops.x where x is a function of minidsa.ops
        return bool(parent) and hasattr(importlib.import_module(parent), name) and not attr
    if not attr or hasattr(mod, attr):
        return True
    try:   # ``from minidsa import viz``: a subpackage, importable though not yet an attribute
        importlib.import_module(f"{module}.{attr}")
        return True
    except ImportError:
        return False


def test_the_helpers_find_what_they_should():
    src = "import minidsa\nfrom minidsa.viz import plot_selection\nminidsa.ops.use_backend('torch')\nminidsa.load()\n"
    assert sorted(names_used(src)) == sorted([("minidsa", ""), ("minidsa.viz", "plot_selection"),
                                               ("minidsa", "ops"), ("minidsa.ops", "use_backend"), ("minidsa", "load")])
    assert resolves("minidsa.ops", "use_backend") and not resolves("minidsa", "no_such_name")
    assert not resolves("minidsa.plot", "plot_selection")   # a module that moved is caught


def test_every_name_in_the_readme_and_notebooks_resolves():
    code = user_code()
    assert len(code) >= 3, "found no README blocks or notebook cells"
    bad = [f"{where}: {mod}{'.' + attr if attr else ''}" for where, src in code
           for mod, attr in names_used(src) if not resolves(mod, attr)]
    assert not bad, "names the README or a notebook uses that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", [minidsa, ops], ids=["minidsa", "minidsa.ops"])
def test_all_lists_resolve(module):
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, missing


def test_the_documented_entry_points_keep_their_place():
    for name in ("generate", "load", "MiniDSA", "train", "TrainConfig", "count_parameters", "checkpoint_manifest",
                 "ForwardTrace", "GenerationTrace", "check_checkpoint", "evaluate", "ops", "mxfp4"):
        assert name in minidsa.__all__ and hasattr(minidsa, name), name
    assert callable(minidsa.generate) and callable(minidsa.ops.sparse_attention)
