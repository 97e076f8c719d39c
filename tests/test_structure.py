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

# Layer table of docs/design.md §13 (there numbered 1..14; here 0..13, same order). A module may import
# only from strictly lower layers, except that the modules of minidsa.ops (all of which count as "ops")
# may import each other, and nothing outside ops.
LAYERS: dict[str, int] = {
    "config": 0, "tokenizer": 0, "ops": 0, "dtypes": 0,
    "quant": 1, "mxfp4": 1, "norm": 1, "ffn": 1, "kv_cache": 1, "shards": 1, "trace": 1,
    "lightning_indexer": 2, "training_ops": 2,
    "mla": 3, "kda": 3, "moe": 3, "vision": 3,
    # initialization is not in the design table: it imports moe (layer 3) and model (layer 5) imports it,
    # so the lowest consistent layer is 4, beside decoder.
    "decoder": 4, "initialization": 4, "data": 4,
    "model": 5,
    "checkpoint": 6, "training_forward": 6,
    "sampling": 7, "prompts": 7, "validator": 7,
    "generate": 8,
    "plot": 9, "indexer_training": 9,
    "evaluation": 10,
    "training": 11,
    "__init__": 12,
    # The design table puts __main__ beside __init__; it is the CLI run after the package is imported
    # and uses the public API (``import minidsa``), so it sits one layer above __init__.
    "__main__": 13,
}

MAX_FUNCTION_LINES = 50
MAX_MODULE_LINES = {"minidsa/model.py": 250, "minidsa/generate.py": 250}   # strictly under


# ------------------------------------------------------------------------------------------ helpers
def package_files() -> list[Path]:
    return sorted(p for p in PKG_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    """minidsa/ops/kda.py -> minidsa.ops.kda; minidsa/ops/__init__.py -> minidsa.ops; minidsa/__init__.py -> minidsa."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def layer_key(module: str) -> str:
    """The name a module has in LAYERS: every minidsa.ops[.x] is "ops"; the package itself is "__init__"."""
    parts = module.split(".")
    assert parts[0] == PKG, module
    if len(parts) == 1:
        return "__init__"
    if parts[1] == "ops":
        return "ops"
    return parts[1]


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


def layer_violations(edges: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    bad = []
    for mod, es in sorted(edges.items()):
        src = layer_key(mod)
        for target, line, _ in es:
            dst = layer_key(target)
            if src == "ops" and dst == "ops":
                continue   # inside ops: allowed (the cycle check still applies)
            if src == "ops":
                bad.append(f"{mod}:{line} imports {target}: ops must not import minidsa outside ops")
            elif LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{mod}:{line} (layer {LAYERS[src]}) imports {target} (layer {LAYERS[dst]})")
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
    got = resolve_imports(ast.parse("from ..config import X\nfrom ._checks import y\n"),
                          "minidsa.ops.kda", False, known)
    assert got == [("minidsa.config", 1, False), ("minidsa.ops._checks", 2, False)]
    # layer rule: an upward import, an ops -> outside import, and a same-layer import are all caught
    bad = layer_violations({"minidsa.norm": [("minidsa.moe", 3, False)],
                            "minidsa.ops.kda": [("minidsa.config", 5, False), ("minidsa.ops._checks", 6, False)],
                            "minidsa.mla": [("minidsa.kda", 7, False)], "minidsa.model": [("minidsa.ops", 8, False)]})
    assert len(bad) == 3 and all(m in " ".join(bad) for m in ("minidsa.norm", "minidsa.ops.kda", "minidsa.mla"))
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


# ------------------------------------------------------------------------------------- 1. import layers
def test_every_module_is_in_the_layer_table():
    _, edges, _ = build_graph()
    keys = {layer_key(m) for m in edges}
    missing = sorted(keys - set(LAYERS))
    stale = sorted(set(LAYERS) - keys)
    assert not missing, f"modules with no layer in tests/test_structure.py LAYERS (docs/design.md §13): {missing}"
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_imports_go_to_lower_layers_only():
    _, edges, _ = build_graph()
    assert sum(len(es) for es in edges.values()) > 20, "the import graph is suspiciously small"
    bad = layer_violations(edges)
    assert not bad, "imports that break the layering of docs/design.md §13:\n" + "\n".join(bad)


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


# ------------------------------------------------------------------------------------------- 3. lengths
def test_functions_are_at_most_50_lines():
    bad = []
    for path in package_files():
        for name, line, n in function_lengths(ast.parse(path.read_text())):
            if n > MAX_FUNCTION_LINES:
                bad.append(f"{path.relative_to(ROOT)}:{line} {name}: {n} lines")
    assert not bad, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(bad)


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
        if len(parts) != 3 or parts[:2] != [PKG, "ops"] or mod not in paths or is_package(paths[mod]):
            bad.append(f"{op}: reference {ref.__qualname__} lives in {mod}, not in a module minidsa/ops/<file>.py")
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


def test_public_wrappers_take_keyword_only_backend():
    from minidsa import ops

    init = PKG_DIR / "ops" / "__init__.py"
    defs = {n.name: n for n in ast.parse(init.read_text()).body if isinstance(n, ast.FunctionDef)}
    bad = []
    for op in sorted(ops.REFERENCES):
        fn = defs.get(op)
        if fn is None:
            bad.append(f"{op}: no public wrapper 'def {op}' in minidsa/ops/__init__.py")
            continue
        names = [a.arg for a in fn.args.kwonlyargs]
        if "backend" not in names:
            bad.append(f"{op}: 'backend' is not keyword-only")
        else:
            default = fn.args.kw_defaults[names.index("backend")]
            if not (isinstance(default, ast.Constant) and default.value is None):
                bad.append(f"{op}: backend does not default to None")
        # the object the package exports is that wrapper
        param = inspect.signature(getattr(ops, op)).parameters.get("backend")
        if param is None or param.kind is not inspect.Parameter.KEYWORD_ONLY or param.default is not None:
            bad.append(f"{op}: minidsa.ops.{op} at runtime lacks a keyword-only backend=None")
    assert not bad, "\n".join(bad)
