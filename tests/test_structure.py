"""Structure of the package: import layers (docs/design.md §13), no intra-package lazy imports,
function and module length, design-document pointers, and the ops/reference/backend contract.

Everything except the last test works on the source with ``ast``; nothing here imports a module
to learn what it imports.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "minidsa"
PKG_DIR = ROOT / PKG
DESIGN = ROOT / "docs" / "design.md"
README = ROOT / "README.md"



def design_units() -> tuple[str, ...]:
    """The package's units from the bottom up, as docs/design.md §13 lists them (the order's one written form):
    its folders and its few top-level modules. Nothing lists modules: a new file joins its folder's unit by
    where it lives."""
    section = DESIGN.read_text().split("## 13.")[1].split("\n## ")[0]
    return tuple(re.findall(r"^\d+\. `([\w]+)(?:/|\.py)`", section, flags=re.M))


# A module may import modules of its own unit and of units below it, never above.
UNITS = design_units()

MAX_FUNCTION_LINES = 50
MAX_FILE_LINES = 450  # every .py file of the package
MAX_MODULE_LINES = {"minidsa/model/minidsa.py": 250, "minidsa/serving/generation.py": 250}   # strictly under


# ------------------------------------------------------------------------------------------ helpers
def package_files() -> list[Path]:
    return sorted(p for p in PKG_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    """minidsa/ops/kda/reference.py -> minidsa.ops.kda.reference; minidsa/ops/__init__.py -> minidsa.ops."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def unit_of(module: str) -> str:
    """The unit a module belongs to: the folder or top-level module under minidsa; the package itself is "__init__"."""
    parts = module.split(".")
    assert parts[0] == PKG, module
    return "__init__" if len(parts) == 1 else parts[1]


def resolve_imports(tree: ast.AST, module: str, is_pkg: bool, known: set[str]) -> list[tuple[str, int, bool]]:
    """Intra-package imports of one module: (target module, line, inside a function body).

    ``from . import x`` targets the submodule x when it is one, else the package's __init__; ``from .x import y``
    targets x, or x.y when that is a submodule. Imports anywhere in the file count (module level, functions,
    TYPE_CHECKING blocks), so a lazy import cannot hide an edge.
    """
    package = module if is_pkg else module.rpartition(".")[0]
    out: list[tuple[str, int, bool]] = []

    def add(target: str, line: int, in_func: bool) -> None:
        # the longest known module that is a prefix of the dotted name
        parts = target.split(".")
        for n in range(len(parts), 0, -1):
            cand = ".".join(parts[:n])
            if cand in known:
                out.append((cand, line, in_func))
                return
        raise AssertionError(f"{module}:{line} imports {target!r}, which is not a module of the package")

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_in_func = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == PKG or alias.name.startswith(PKG + "."):
                        add(alias.name, child.lineno, in_func)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base_parts = package.split(".")
                    if child.level > 1:
                        base_parts = base_parts[: len(base_parts) - (child.level - 1)]
                    assert base_parts and base_parts[0] == PKG, f"{module}:{child.lineno} imports above the package"
                    base = ".".join(base_parts + ([child.module] if child.module else []))
                elif child.module and (child.module == PKG or child.module.startswith(PKG + ".")):
                    base = child.module
                else:
                    base = None
                if base is not None:
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        add(sub if sub in known else base, child.lineno, in_func)
            visit(child, child_in_func)

    visit(tree, False)
    return out


def build_graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[str, int, bool]]], dict[str, Path]]:
    paths = {module_name(p): p for p in package_files()}
    known = set(paths)
    edges: dict[str, list[tuple[str, int, bool]]] = {}
    for mod, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges[mod] = resolve_imports(tree, mod, is_package(path), known)
    graph = {mod: {t for t, _, _ in es if t != mod} for mod, es in edges.items()}
    return graph, edges, paths


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle [a, b, ..., a] of the directed graph, or None (recursive DFS with three colours)."""
    white, grey, black = 0, 1, 2
    colour = {n: white for n in graph}
    for targets in graph.values():
        for t in targets:
            colour.setdefault(t, white)
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        colour[n] = grey
        stack.append(n)
        for t in sorted(graph.get(n, ())):
            if colour[t] == grey:
                return stack[stack.index(t):] + [t]
            if colour[t] == white:
                found = dfs(t)
                if found:
                    return found
        stack.pop()
        colour[n] = black
        return None

    for n in sorted(colour):
        if colour[n] == white:
            found = dfs(n)
            if found:
                return found
    return None


def order_violations(edges: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    """Imports that go to a unit above the importer's (same-unit imports are allowed; cycles are checked apart)."""
    bad = []
    for mod, es in sorted(edges.items()):
        src = unit_of(mod)
        for target, line, _ in es:
            dst = unit_of(target)
            if UNITS.index(dst) > UNITS.index(src):
                bad.append(f"{mod}:{line} ({src}) imports {target} ({dst}), which sits above it")
    return bad


def function_lengths(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of every def; lineno is the def line, so decorators are excluded."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


POINTER = re.compile(r"(?:docs/)?design\.md\s+§\s*(\d+)((?:\s*,\s*§\s*\d+)*)")
HEADING = re.compile(r"^## (\d+)\.", re.MULTILINE)
SPEC_MENTION = re.compile(r"\bSPEC\s+sections?\b", re.IGNORECASE)
README_LINK = re.compile(r"\]\(\s*(?:\./)?docs/design\.md(?:#[^)]*)?\s*\)|href=[\"'](?:\./)?docs/design\.md")


def design_pointers(text: str) -> list[int]:
    """Section numbers named by 'docs/design.md §N' and any ', §M' list right after it."""
    found = []
    for m in POINTER.finditer(text):
        found.append(int(m.group(1)))
        found += [int(n) for n in re.findall(r"§\s*(\d+)", m.group(2))]
    return found


def imports_triton(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "triton" or a.name.startswith("triton.") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                (node.module == "triton" or node.module.startswith("triton.")):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and node.args[0].value.split(".")[0] == "triton" and \
                (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) == "__import__"):
            lines.append(node.lineno)
    return lines


# ------------------------------------------------------------------------------ self-tests of helpers
def test_helpers_detect_what_they_should():
    # cycle detector
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) in (
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"])
    assert find_cycle({"a": {"a2"}, "a2": {"a2"}}) == ["a2", "a2"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    # import resolution, including lazy and relative-parent imports
    known = {"minidsa", "minidsa.ops", "minidsa.ops._checks", "minidsa.config", "minidsa.model", "minidsa.mxfp4"}
    src = ("from . import mxfp4, ops\nfrom .ops._checks import on_host\nimport minidsa.config\n"
           "from minidsa.model import MiniDSA\nimport torch\nfrom . import load\n"
           "def f():\n    import minidsa\n    from PIL import Image\n")
    got = resolve_imports(ast.parse(src), "minidsa.model", False, known)
    assert sorted(got) == sorted([
        ("minidsa.mxfp4", 1, False), ("minidsa.ops", 1, False), ("minidsa.ops._checks", 2, False),
        ("minidsa.config", 3, False), ("minidsa.model", 4, False), ("minidsa", 6, False), ("minidsa", 8, True)])
    got = resolve_imports(ast.parse("from ...config import X\nfrom .._checks import y\n"),
                          "minidsa.ops.kda.reference", False, known)
    assert got == [("minidsa.config", 1, False), ("minidsa.ops._checks", 2, False)]
    # folder order: an import of a unit above is caught; the same unit and units below are not
    bad = order_violations({"minidsa.formats.fp8": [("minidsa.model.moe", 3, False)],
                            "minidsa.ops.kda.reference": [("minidsa.config", 5, False), ("minidsa.ops._checks", 6, False)],
                            "minidsa.model.mla": [("minidsa.model.kda", 7, False), ("minidsa.serving", 9, False)],
                            "minidsa.model": [("minidsa.ops", 8, False)]})
    assert len(bad) == 2 and "minidsa.formats.fp8:3" in bad[0] and "minidsa.model.mla:9" in bad[1], bad
    assert unit_of("minidsa") == "__init__" and unit_of("minidsa.ops.mla.reference") == "ops"
    # function length: decorators excluded, docstring included
    src = "class A:\n    @staticmethod\n    def f():\n        '''doc'''\n        return 1\n"
    assert function_lengths(ast.parse(src)) == [("A.f", 3, 3)]
    # design pointers
    text = "(docs/design.md §3, §10 trap 4) and docs/design.md §10, trap 1; docs/design.md\n    §2, §4. SPEC §9"
    assert design_pointers(text) == [3, 10, 10, 2, 4]
    assert SPEC_MENTION.search("see SPEC section 4") and not SPEC_MENTION.search("SPECIAL_TOKENS section")
    assert README_LINK.search("[design](docs/design.md)") and not README_LINK.search("docs/design.md")
    # triton detection
    assert imports_triton(ast.parse("def k():\n    import triton.language as tl\n")) == [2]
    assert imports_triton(ast.parse("from triton import jit\n")) == [1]
    assert imports_triton(ast.parse("import torch\nfrom .triton import x\n")) == []


# ------------------------------------------------------------------------------------- 1. folder order
def test_every_unit_is_in_the_order():
    """``ls minidsa`` and UNITS name the same things: a new folder must be placed in the order."""
    _, edges, _ = build_graph()
    units = {unit_of(m) for m in edges}
    missing, stale = sorted(units - set(UNITS)), sorted(set(UNITS) - units)
    assert not missing, f"folders or modules of minidsa/ missing from UNITS in tests/test_structure.py: {missing}"
    assert not stale, f"UNITS names what minidsa/ does not have: {stale}"


def test_imports_go_to_units_below_only():
    _, edges, _ = build_graph()
    assert sum(len(es) for es in edges.values()) > 20, "the import graph is suspiciously small"
    bad = order_violations(edges)
    assert not bad, "imports that break the folder order of docs/design.md §13:\n" + "\n".join(bad)


def test_import_graph_has_no_cycle():
    graph, _, _ = build_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# --------------------------------------------------------------------------- 2. no lazy package imports
def test_no_intra_package_import_inside_a_function():
    _, edges, paths = build_graph()
    bad = [f"{paths[m].relative_to(ROOT)}:{line} imports {target} inside a function"
           for m, es in sorted(edges.items()) for target, line, in_func in es if in_func]
    # importlib with a literal package name is a lazy import too
    for mod, path in sorted(paths.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                    isinstance(node.args[0].value, str) and \
                    (node.args[0].value.startswith(".") or node.args[0].value.split(".")[0] == PKG) and \
                    (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) == "__import__"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.args[0].value!r} through importlib")
    assert not bad, "intra-package imports must be at module level:\n" + "\n".join(bad)


def test_no_private_name_is_imported_from_another_file():
    """A helper another file needs carries a public name; an underscore name stays in its own file (a module
    whose name starts with an underscore, such as ``ops/_checks.py``, is the package's own and may be imported)."""
    bad = [f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {node.module}"
           for path in package_files() for node in ast.walk(ast.parse(path.read_text()))
           if isinstance(node, ast.ImportFrom)
           for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not bad, "private names imported across files:\n" + "\n".join(bad)

# ------------------------------------------------------------------------------------------- 3. lengths
def test_functions_are_at_most_50_lines():
    bad = []
    for path in package_files():
        for name, line, n in function_lengths(ast.parse(path.read_text())):
            if n > MAX_FUNCTION_LINES:
                bad.append(f"{path.relative_to(ROOT)}:{line} {name}: {n} lines")
    assert not bad, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(bad)


def test_files_are_at_most_450_lines():
    bad = [f"{p.relative_to(ROOT)}: {n} lines" for p in package_files()
           if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not bad, f"package files over {MAX_FILE_LINES} lines (split by what they do):\n" + "\n".join(bad)


@pytest.mark.parametrize("rel", sorted(MAX_MODULE_LINES))
def test_module_length(rel):
    n = len((ROOT / rel).read_text().splitlines())
    assert n < MAX_MODULE_LINES[rel], f"{rel} has {n} lines; it must stay under {MAX_MODULE_LINES[rel]}"


# ------------------------------------------------------------------------------------ 4. design pointers
def test_design_pointers_resolve():
    sections = {int(n) for n in HEADING.findall(DESIGN.read_text())}
    assert sections, f"no '## N.' headings in {DESIGN}"
    seen, bad = 0, []
    for path in package_files():
        for n in design_pointers(path.read_text()):
            seen += 1
            if n not in sections:
                bad.append(f"{path.relative_to(ROOT)}: docs/design.md §{n} has no '## {n}.' heading")
    assert seen > 10, f"only {seen} docs/design.md pointers found: is the pattern still right?"
    assert not bad, "\n".join(bad)


def test_no_spec_section_mentions():
    bad = []
    for path in sorted(p for p in PKG_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for m in SPEC_MENTION.finditer(text):
            bad.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
    assert not bad, "the repository has no SPEC; point at docs/design.md instead:\n" + "\n".join(bad)


def test_readme_links_design_document():
    assert DESIGN.is_file()
    linked = README_LINK.search(README.read_text()) is not None
    assert linked, "README.md has no markdown link to docs/design.md, e.g. [design](docs/design.md)"


# ---------------------------------------------------------------------------------- 5. ops and backends
def test_references_live_in_triton_free_modules():
    from minidsa import ops

    graph, _, paths = build_graph()
    assert ops.REFERENCES, "minidsa.ops.REFERENCES is empty"
    bad = []
    for op, ref in sorted(ops.REFERENCES.items()):
        mod = ref.__module__
        parts = mod.split(".")
        if len(parts) != 4 or parts[:2] != [PKG, "ops"] or parts[3] != "reference" or mod not in paths:
            bad.append(f"{op}: reference {ref.__qualname__} lives in {mod}, not in minidsa/ops/<op>/reference.py")
            continue
        # the module and every ops module it imports, transitively
        todo, done = [mod], set()
        while todo:
            m = todo.pop()
            if m in done:
                continue
            done.add(m)
            for line in imports_triton(ast.parse(paths[m].read_text())):
                bad.append(f"{op}: {paths[m].relative_to(ROOT)}:{line} imports triton"
                           + ("" if m == mod else f" (imported by {mod})"))
            todo += [t for t in graph[m] if t.startswith(PKG + ".ops.")]
    assert not bad, "\n".join(bad)


def test_public_ops_take_keyword_only_backend():
    """Every public op is its reference's signature plus a keyword-only ``backend=None``, as help() shows it."""
    from minidsa import ops

    bad = []
    for op in sorted(ops.REFERENCES):
        params = list(inspect.signature(getattr(ops, op)).parameters.values())
        if [p.name for p in params[:-1]] != list(inspect.signature(ops.REFERENCES[op]).parameters):
            bad.append(f"{op}: its arguments are not its reference's")
        last = params[-1]
        if last.name != "backend" or last.kind is not inspect.Parameter.KEYWORD_ONLY or last.default is not None:
            bad.append(f"{op}: minidsa.ops.{op} at runtime lacks a keyword-only backend=None")
    assert not bad, "\n".join(bad)


def test_kernels_sit_beside_their_reference():
    """Each registered kernel lives in its op's folder, in a file named for its backend (``*_triton.py``,
    ``*_gluon.py``)."""
    from minidsa import ops

    bad = []
    for kind, table in (("_triton", ops.TRITON_KERNELS), ("_gluon", ops.GLUON_KERNELS)):
        for op, (module, _) in sorted(table.items()):
            folder = ops.REFERENCES[op].__module__.rpartition(".")[0]
            if module.rpartition(".")[0] != folder or not module.endswith(kind):
                bad.append(f"{op}: kernel module {module} is not a *{kind} module in {folder}")
    assert not bad, "\n".join(bad)


def test_every_environment_switch_is_in_the_design_table():
    """Each MINIDSA_* variable the package reads has a row in docs/design.md's one table of switches."""
    read = set()
    for path in package_files():
        read |= set(re.findall(r"environ(?:\.get)?\(\s*[\"'](MINIDSA_\w+)", path.read_text()))
        read |= set(re.findall(r"environ\[\s*[\"'](MINIDSA_\w+)", path.read_text()))
    assert read, "found no MINIDSA_* switches: is the pattern still right?"
    text = DESIGN.read_text()
    section = text[text.index("### Environment switches"):]
    rows = set(re.findall(r"^\| `(MINIDSA_\w+)` \|", section, flags=re.MULTILINE))
    assert read == rows, f"read by the package: {sorted(read)}; rows in the table: {sorted(rows)}"
