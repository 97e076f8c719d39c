"""Execute the notebooks in place, so a reader on GitHub sees every output and picture without running anything.

    pip install -e ".[notebooks]"
    python notebooks/build.py              # every notebook
    python notebooks/build.py 01 03        # the notebooks whose names start with these prefixes

Each notebook runs top to bottom in a fresh kernel on one CPU thread (OMP_NUM_THREADS=1), from the notebooks
folder, and is saved in nbformat 4.5 with cell ids. A failing cell stops the build with its error. The first
picture of the cell tagged "readme" is written to docs/images/<notebook name>.png, the README's picture of it.
"""

from __future__ import annotations

import base64
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
IMAGES = HERE.parent / "docs" / "images"
TIMEOUT_S = 600  # per cell; a notebook is meant to finish in well under 3 minutes


def build(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    nb.nbformat, nb.nbformat_minor = 4, 5
    _, nb = nbformat.validator.normalize(nb)   # adds the cell ids nbformat 4.5 requires
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    start = time.perf_counter()
    NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    elapsed = time.perf_counter() - start
    nbformat.validate(nb)
    nbformat.write(nb, path)
    save_readme_picture(nb, path.stem)
    return elapsed


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
