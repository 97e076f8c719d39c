"""The reading path of one MLA + DSA layer stays short: what a learner reads from the layer to the formulas.

Counted: the whole source (signature, docstring, body) of every function of the package that runs, once
each, in one forward of an MLA layer's attention without a cache, on the plain references (backend "torch").
Not counted: the op decorator's dispatch (``ops/_dispatch.py``: "go to definition" on ``ops.<op>`` lands on the
reference itself) and argument checks (``ops/_checks.py``, ``ops/<op>/checks.py`` and ``check_*`` functions:
one call line in the function that makes it). Comprehensions and lambdas are inside functions counted already.
"""

import inspect
import sys
from pathlib import Path

import torch

import minidsa

PACKAGE = Path(minidsa.__file__).resolve().parent
MAX_LINES = 300


def functions_run(fn) -> dict[tuple[str, str], int]:
    """(file relative to the package, function name) -> source lines, for every package function ``fn()`` runs."""
    seen = {}

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(str(PACKAGE)) and not code.co_name.startswith("<"):
            seen.setdefault((code.co_filename, code.co_firstlineno), code)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {(str(Path(f).relative_to(PACKAGE)), code.co_name): len(inspect.getsourcelines(code)[0])
            for (f, _), code in seen.items()}


def on_the_path(file: str, name: str) -> bool:
    return file not in ("ops/_dispatch.py", "ops/_checks.py") and not file.endswith("checks.py") \
        and not name.startswith("check")


def test_one_mla_dsa_layer_reads_in_at_most_300_lines():
    model = minidsa.load("default", progress=False)
    layer = next(layer for layer in model.language_model.model.layers if layer.layer_type == "mla")
    x = torch.randn(1, 16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), minidsa.ops.use_backend("torch"):
        layer.attention(x, None, None)  # lazy imports and caches first: they are not the path
        run = functions_run(lambda: layer.attention(x, None, None))
    path = {k: n for k, n in run.items() if on_the_path(*k)}
    # the path does reach the formulas: the indexer's scores, the top-k, the sparse attention
    assert {("ops/indexer/reference.py", "index_scores"), ("ops/attention/reference.py", "sparse_attention")} <= set(path)
    assert any(name == "topk_indices" for _, name in path)
    lines = sum(path.values())
    assert lines <= MAX_LINES, "\n".join(f"{n:4d} {f}:{name}" for (f, name), n in sorted(path.items())) + f"\n{lines}"
