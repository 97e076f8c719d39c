"""Execute the notebooks in place, so a reader on GitHub sees every output and picture without running anything.

    pip install -e ".[notebooks]"
    python notebooks/build.py              # every notebook
    python notebooks/build.py 01 03        # the notebooks whose names start with these prefixes

Each notebook runs top to bottom in a fresh kernel on one CPU thread (OMP_NUM_THREADS=1), from the notebooks
folder, and is saved in nbformat 4.5 with cell ids. A failing cell stops the build with its error. The first
picture of the cell tagged "readme" is written to docs/images/<notebook name>.png, the README's picture of it.

The stored notebook records a digest of the code it ran (metadata "executed_code_sha256"), so a test can tell
stored outputs that no longer belong to the code. A notebook whose outputs hold what a reader must not see
(anything on stderr, a warning, a path of the machine that built it) or whose cells hold a control character
(a LaTeX `\\frac` written through a Python string turns into a form feed) is not written: the build names the cells.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
IMAGES = HERE.parent / "docs" / "images"
TIMEOUT_S = 600  # per cell; a notebook is meant to finish in well under 3 minutes
# Paths of the building machine (a reader has other ones) and warnings; tests/test_notebooks.py checks the same
MACHINE_PATH = re.compile(r"(?<![\w.$~-])(/(work|home|root|tmp|Users|private|var/folders)/|[A-Za-z]:\\Users\\)")
WARNING = re.compile(r"\w*Warning\b")
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")  # every control character but the newline


def build(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    nb.nbformat, nb.nbformat_minor = 4, 5
    _, nb = nbformat.validator.normalize(nb)   # adds the cell ids nbformat 4.5 requires
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    start = time.perf_counter()
    NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    elapsed = time.perf_counter() - start
    nb.metadata["executed_code_sha256"] = code_digest(nb)
    nbformat.validate(nb)
    found = problems(nb)
    if found:
        raise ValueError(f"{path.name} was not written:\n  " + "\n  ".join(found))
    nbformat.write(nb, path)
    save_readme_picture(nb, path.stem)
    return elapsed


def code_digest(nb) -> str:
    """sha256 of the code cells' sources in order, each cell's ended by a NUL: the code the outputs came from."""
    code = "".join(_text(c["source"]) + "\0" for c in nb["cells"] if c["cell_type"] == "code")
    return hashlib.sha256(code.encode()).hexdigest()


def problems(nb) -> list[str]:
    """What the stored notebook must not show a reader, one line per cell and kind."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        if CONTROL.search(_text(cell["source"])):
            found.append(f"cell {i}: a control character in its source: {CONTROL.search(_text(cell['source']))[0]!r}")
        for out in cell.get("outputs", []):
            text = output_text(out)
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                found.append(f"cell {i}: output on stderr: {text[:200]!r}")
            elif out.get("output_type") == "error":
                found.append(f"cell {i}: an error: {out.get('ename')}")
            if WARNING.search(text):
                found.append(f"cell {i}: a warning in its output: {WARNING.search(text)[0]}")
            if MACHINE_PATH.search(text):
                found.append(f"cell {i}: a path of this machine in its output: {MACHINE_PATH.search(text)[0]}...")
    return found


def output_text(out) -> str:
    """Every text an output holds (stream, text/* and JSON data, traceback); pictures are not text."""
    parts = [_text(out.get("text", ""))] + [_text(out.get("traceback", []))]
    parts += [str(v) if k.endswith("json") else _text(v) for k, v in out.get("data", {}).items()
              if k.startswith("text/") or k.endswith("json")]
    return "\n".join(parts)


def _text(value) -> str:
    return value if isinstance(value, str) else "".join(value)


def save_readme_picture(nb, stem: str) -> None:
    """The first PNG output of the cell tagged "readme", as docs/images/<stem>.png (none tagged: nothing)."""
    for cell in nb.cells:
        if cell.cell_type == "code" and "readme" in cell.metadata.get("tags", []):
            for out in cell.get("outputs", []):
                png = out.get("data", {}).get("image/png")
                if png:
                    IMAGES.mkdir(parents=True, exist_ok=True)
                    (IMAGES / f"{stem}.png").write_bytes(base64.b64decode(png))
                    return
            raise ValueError(f"{stem}: the cell tagged 'readme' drew no picture")


def main(prefixes: list[str]) -> int:
    os.environ["OMP_NUM_THREADS"] = "1"   # inherited by the kernel
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    paths = sorted(p for p in HERE.glob("*.ipynb") if not prefixes or p.name.startswith(tuple(prefixes)))
    if not paths:
        print(f"no notebook matches {prefixes}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"{p.name}: {build(p):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
