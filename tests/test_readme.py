"""The README's usage example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert isinstance(namespace["text"], str) and len(namespace["texts"]) == 2
    assert namespace["trace"].selected and namespace["tr"].depth_weights


def test_readme_shipped_model_example_prints_what_its_comments_say(capsys):
    """The second example: the shipped checkpoint answers the pass-key prompt and names the drawn shape,
    printing what the example's comments promise (one line per print)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "pass key" in b)
    want = re.findall(r"print\(.*\)\s+# (.+)", example)
    assert len(want) == 2, want
    exec(compile(example, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip().splitlines() == want


def test_readme_engine_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "minidsa.Engine(" in b)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    outs = namespace["outs"]
    assert [o.finished for o in outs] == [True, True] and all(o.token_ids for o in outs)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].split()[1] == "True" and lines[-1] == "0 0"  # the last step finishes it; no preemption, no hit
    assert all(line.split()[1] == "False" for line in lines[:-2])
