"""What a new user meets on a first run and with bad input, one table per group: the README's
set-up order, thread counts, damaged checkpoints, errors that are ValueError/TypeError naming the value,
leftovers, and the CLI's output."""

import io
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import minidsa
from minidsa.checkpoint.loading import check_values
from minidsa.checkpoint.manifest import checkpoint_manifest
from minidsa.cli import human_count, main, printable
from minidsa.formats import mxfp4, shards

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
INDEX = shards.INDEX_NAME
EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight_(packed|scale)$")


def copy_of(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved[1], tmp_path / "ckpt"))


def weight_map(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX).read_text())["weight_map"]


def rewrite(path: Path, name: str, change) -> None:
    """change(tensor) -> tensor for ``name``, saved as valid safetensors with its checksum re-recorded, so
    the value check (not the checksum) is what must catch it."""
    index = json.loads((path / INDEX).read_text())
    fname = index["weight_map"][name]
    tensors = load_file(str(path / fname))
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, str(path / fname))
    index["metadata"]["checksums"][fname] = shards.file_checksum(path / fname)
    (path / INDEX).write_text(json.dumps(index))


def first_named(path: Path, suffix: str) -> str:
    return next(n for n in weight_map(path) if n.endswith(suffix))


# ------------------------------------------------------------------ 1. install order in the README
def bash_commands(text: str) -> list[str]:
    """Commands of the first bash block, comments dropped."""
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def section_tests_commands(text: str) -> list[str]:
    """Commands of the bash block of the README's Tests section, comments dropped."""
    return bash_commands(text[text.index("\n## Tests\n"):])


def before_first_block(text: str) -> str:
    return text[: text.index("```bash")]


INSTALL_ORDER = [  # what a CPU-only user following the README top to bottom must get
    ("the first command installs the CPU build of torch",
     lambda: re.fullmatch(r"pip install torch --index-url https://download\.pytorch\.org/whl/cpu",
                          bash_commands(README)[0])),
    ("minidsa alone is installed right after it: a first run needs no test extras (they pull triton, 1 GB)",
     lambda: bash_commands(README)[1] == "pip install -e ."),
    ("the Tests section installs the test extras before its first pytest command",
     lambda: section_tests_commands(README)[0] == 'pip install -e ".[test]"'
     and section_tests_commands(README)[1].startswith("python -m pytest")),
    ("that block is the README's first code block", lambda: "```" not in before_first_block(README)),
    ("what a GPU machine runs instead is said before the commands",
     lambda: "GPU run `pip install torch` instead" in " ".join(before_first_block(README).split())),
    ("the README's test command is the one .ci/run runs",
     lambda: "python -m pytest -q tests" in README and "python -m pytest -q tests" in CI),
    (".ci/run also installs CPU torch before the package",
     lambda: 0 <= CI.index("pip install -q torch==2.13.0") < CI.index('pip install -q -e ".[test]"')),
]


@pytest.mark.parametrize("claim, holds", INSTALL_ORDER, ids=[c for c, _ in INSTALL_ORDER])
def test_install_order(claim, holds):
    assert holds(), claim


# ------------------------------------------------------------------ 2. threads
@pytest.fixture
def threads_restored():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


THREADS = [  # entry point, the call, the thread count afterwards (None: the caller's, untouched)
    ("CLI default", lambda: main(["params", "tiny"]), 1),
    ("CLI --threads 2", lambda: main(["params", "tiny", "--threads", "2"]), 2),
    ("library generate", lambda: minidsa.generate("hi", max_new_tokens=2), None),
    ("library load", lambda: minidsa.load("tiny"), None),
]


@pytest.mark.parametrize("entry, call, expected", THREADS, ids=[t[0] for t in THREADS])
def test_thread_count(threads_restored, capsys, entry, call, expected):
    torch.set_num_threads(3)
    call()
    assert torch.get_num_threads() == (3 if expected is None else expected)


def test_notebooks_and_readme_set_the_thread_default():
    for nb in NOTEBOOKS:
        first = next(c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        assert "torch.set_num_threads(1)" in "".join(first["source"]), nb.name
    assert "--threads" in README and "torch.set_num_threads(1)" in README


# ------------------------------------------------------------------ 3. damaged checkpoints
def flip_bit(path: Path, where) -> None:
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    pos = {"header": 8 + 20, "first data byte": header, "middle": (header + len(data)) // 2,
           "last byte": len(data) - 1}[where]
    data[pos] ^= 0x01  # one bit: the smallest damage, and still a valid number almost anywhere
    path.write_bytes(bytes(data))


def pick_shard(path: Path, which: str) -> Path:
    by_shard: dict[str, list[str]] = {}
    for name, fname in weight_map(path).items():
        by_shard.setdefault(fname, []).append(name)
    expert_only = sorted(f for f, names in by_shard.items() if all(EXPERT.search(n) for n in names))
    assert expert_only, "the fixture must have a shard holding only experts"
    return path / {"first": min(by_shard), "last": max(by_shard), "experts only": expert_only[0]}[which]


FLIPS = [  # which shard, where the bit flips, loaded lazily
    ("first", "header", False), ("first", "first data byte", False), ("last", "middle", False),
    ("last", "last byte", False), ("experts only", "middle", False), ("experts only", "middle", True),
    ("first", "middle", True),
]


@pytest.mark.parametrize("which, where, lazy", FLIPS)
def test_flipped_bit_is_caught_by_the_shard_checksum(saved, tmp_path, which, where, lazy):
    path = copy_of(saved, tmp_path)
    shard = pick_shard(path, which)
    flip_bit(shard, where)
    msg = rf"shard {shard.name} does not match its checksum"
    if lazy and which == "experts only":  # nothing of it is read at load; the first expert read verifies it
        model = minidsa.load(path, lazy_experts=True, progress=False)
        for _ in range(2):  # and keeps failing: a failed check is not remembered as passed
            with pytest.raises(ValueError, match=msg):
                model.materialize_experts()
    else:
        with pytest.raises(ValueError, match=msg):
            minidsa.load(path, lazy_experts=lazy, progress=False)


def test_lazy_experts_not_yet_read_hold_zeros_not_garbage(saved):
    """A forward converts unrouted experts as fixed-shape placeholders; their storage, still on disk, must
    be finite (it was to_empty's garbage, where a 0xFF scale times a zero gate gave NaN logits)."""
    model, path = saved
    lazy = minidsa.load(path, lazy_experts=True, progress=False)
    for moe in lazy.moe_layers():
        assert not moe.experts.packed.any() and not moe.experts.scales.any()
    ids = torch.tensor([[256, 104]])  # 2 tokens x top_k slots: fewer experts routed than slots, so placeholders
    with torch.no_grad():
        assert torch.equal(lazy(ids), model(ids))


def test_checksums_are_optional_and_only_sha256_is_known(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    index = json.loads((path / INDEX).read_text())
    fname = sorted(index["metadata"]["checksums"])[0]
    index["metadata"]["checksums"][fname] = "md5:0"
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"checksum 'md5:0' for {fname}"):
        minidsa.load(path, progress=False)
    del index["metadata"]["checksums"]  # as written by older minidsa: loads, unverified
    (path / INDEX).write_text(json.dumps(index))
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.equal(minidsa.load(path, progress=False)(ids), saved[0](ids))


NON_FINITE = [  # a tensor of each kind (by name suffix), the value planted in it
    ("language_model.lm_head.weight", float("nan")),
    ("language_model.model.norm.weight", float("inf")),
    (".self_attn.A_log", float("-inf")),  # F32 on disk
    (".indexer.weights_proj.weight", float("nan")),
    (".gate.e_score_correction_bias", float("nan")),
    (".input_layernorm.weight", float("nan")),
    ("vision_tower.patch_embed.proj.weight", float("inf")),
    ("mm_projector.post_norm.weight", float("nan")),
]


@pytest.mark.parametrize("suffix, value", NON_FINITE, ids=[s.strip(".") for s, _ in NON_FINITE])
def test_non_finite_weight_is_named_at_load(saved, tmp_path, suffix, value):
    path = copy_of(saved, tmp_path)
    name = first_named(path, suffix)

    def plant(t):
        t.view(-1)[t.numel() // 2] = value
        return t
    rewrite(path, name, plant)
    with pytest.raises(ValueError, match=re.escape(name) + r" holds \d NaN and \d Inf"):
        minidsa.load(path, progress=False)


def test_every_floating_tensor_is_checked_for_nan_and_inf():
    """check_values names any floating tensor of the manifest holding one NaN, +Inf or -Inf, and passes a finite one."""
    for name, (shape, dtype) in checkpoint_manifest("tiny").items():
        if dtype == "U8":
            continue
        t = torch.zeros(shape)
        check_values(name, t)
        for bad in (float("nan"), float("inf"), float("-inf")):
            t.view(-1)[-1] = bad
            with pytest.raises(ValueError, match=re.escape(name)):
                check_values(name, t)


E8M0 = [  # scale code planted in one expert scale, loaded lazily, error (None: it loads)
    (0xFF, False, "holds the E8M0 NaN code 0xFF"),
    (0xFE, False, r"holds the E8M0 scale code 0xfe = 2\^127"),
    (0xFE, True, r"holds the E8M0 scale code 0xfe = 2\^127"),
    (mxfp4.E8M0_MAX_PLAUSIBLE + 1, False, f"holds the E8M0 scale code {mxfp4.E8M0_MAX_PLAUSIBLE + 1:#04x}"),
    (mxfp4.E8M0_MAX_PLAUSIBLE, False, None),  # the largest code a trained weight might still need
]


@pytest.mark.parametrize("code, lazy, msg", E8M0)
def test_absurd_e8m0_scale_is_named_at_load(saved, tmp_path, code, lazy, msg):
    path = copy_of(saved, tmp_path)
    name = first_named(path, ".experts.3.w2.weight_scale")

    def plant(t):
        t[0, 0] = code
        return t
    rewrite(path, name, plant)
    if msg is None:
        minidsa.load(path, progress=False)
        return
    if lazy:  # the header is fine; the value is checked when the expert is read
        read = minidsa.load(path, lazy_experts=True, progress=False).materialize_experts
    else:
        def read():
            minidsa.load(path, progress=False)
    with pytest.raises(ValueError, match=re.escape(name) + " " + msg):
        read()


# ------------------------------------------------------------------ 4. errors name the value and the fix
def bomb_png(path: Path) -> str:
    """A PNG declaring 20000 x 20000 pixels (4e8, past Pillow's refusal at 2 x 89.5 M) with no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
                     + chunk(b"IEND", b""))
    return str(path)


def gen(prompt="x", **kw):
    return lambda d: minidsa.generate(prompt, "tiny", max_new_tokens=2, **kw)


PROBES = [  # id, the bad call (given a scratch directory), the error's class, what it must name
    ("decompression bomb", lambda d: gen(images=[bomb_png(d / "bomb.png")])(d), ValueError,
     r"bomb\.png' is too large to decode safely .*MAX_IMAGE_PIXELS"),
    ("directory as image", lambda d: gen(images=[str(d)])(d), ValueError, r"' is a directory; pass the path of"),
    ("missing image", lambda d: gen(images=[str(d / "none.png")])(d), ValueError, r"none\.png' does not exist"),
    ("shard file to load", lambda d: minidsa.load(d / "model-00001-of-00001.safetensors"), ValueError,
     r"model-00001-of-00001\.safetensors' is one file of a checkpoint; pass its directory"),
    ("index file to load", lambda d: minidsa.load(str(d / INDEX)), ValueError, "is one file of a checkpoint"),
    ("binary file as config", lambda d: (d / "x.cfg").write_bytes(b"\x89PNG\xff\xfe") and minidsa.load(d / "x.cfg"),
     ValueError, r"x\.cfg' is not text"),
    ("seed 2**70", gen(seed=2**70), ValueError, f"seed = {2**70} is outside"),
    ("negative seed", gen(seed=-1), ValueError, "seed = -1 is outside"),
    ("seed + row past 2**64", gen(["a", "b"], seed=2**64 - 1), ValueError, f"seed = {2**64 - 1} .*2\\*\\*64 - 2"),
    ("seed of another type", gen(seed=1.5), TypeError, "seed must be an int or None, got 1.5"),
    ("max_shard_size 0MB", lambda d: minidsa.load("tiny").save_pretrained(d / "s", "0MB"), ValueError,
     "max_shard_size = '0MB'"),
    ("max_shard_size below a tensor", lambda d: minidsa.load("tiny").save_pretrained(d / "s", "1KB"), ValueError,
     r"max_shard_size = '1KB' \(1,000 bytes\) is smaller than the largest tensor, .* use at least"),
]


@pytest.mark.parametrize("probe, call, exc, msg", PROBES, ids=[p[0] for p in PROBES])
def test_bad_input_is_a_value_or_type_error_naming_the_value(tmp_path, probe, call, exc, msg):
    (tmp_path / "model-00001-of-00001.safetensors").touch()  # recognised by name, before any reading
    (tmp_path / INDEX).touch()
    with pytest.raises(Exception) as info:
        call(tmp_path)
    assert type(info.value) is exc and re.search(msg, str(info.value)), f"{type(info.value).__name__}: {info.value}"


@pytest.fixture(scope="module")
def cli_scratch(tmp_path_factory):
    """A folder with a checkpoint (ckpt), the same with one NaN in lm_head (nan) and a decompression bomb."""
    d = tmp_path_factory.mktemp("cli")
    minidsa.load("tiny").save_pretrained(d / "ckpt", max_shard_size="2GB")
    shutil.copytree(d / "ckpt", d / "nan")

    def plant(t):
        t[5, 0] = float("nan")
        return t
    rewrite(d / "nan", "language_model.lm_head.weight", plant)
    bomb_png(d / "bomb.png")
    return d


CLI_PROBES = [  # argv (given the scratch folder), what the one line must say
    (lambda d: ["generate", "x", "--image", str(d / "bomb.png")], "too large to decode safely"),
    (lambda d: ["generate", "x", "--image", str(d)], "is a directory"),
    (lambda d: ["generate", "x", "--config", str(d / "ckpt" / "model-00001-of-00001.safetensors")],
     "is one file of a checkpoint"),
    (lambda d: ["generate", "x", "--config", str(d / "nan")], r"lm_head\.weight holds 1 NaN and 0 Inf"),
    (lambda d: ["generate", "x", "--seed", str(2**70)], f"seed = {2**70}"),
    (lambda d: ["generate", "x", "--max-new-tokens", "abc"], "invalid int value: 'abc'"),
    (lambda d: ["generate", "x", "--max-new-tokens", "100000"], "max_new_tokens = 100000"),
    (lambda d: ["generate", "x", "--threads", "0"], "'0' is not a positive integer"),
    (lambda d: ["params", "nope"], "unknown config name 'nope'"),
    (lambda d: ["check-checkpoint", str(d / "nothing")], "nothing"),
    (lambda d: [], "the following arguments are required: command"),
    # '' is not the working directory; the next ones name what was passed and the fix
    (lambda d: ["generate", "x", "--config", ""], "config name '' is empty; pass a preset name"),
    (lambda d: ["params", ""], "config name '' is empty"),
    (lambda d: ["check-checkpoint", ""], "checkpoint directory '' is empty"),
    (lambda d: ["train", "--config", "", "--out", str(d / "run")], "config name '' is empty"),
    (lambda d: ["eval", "--checkpoint", ""], "config name '' is empty"),
    # bytes that are not UTF-8 arrive from the shell as lone surrogates: the fix is a shell one
    (lambda d: ["generate", os.fsdecode(b"ab\xff")], r"not UTF-8 \(it holds the bytes b'\\xff'\); .*LANG=C.UTF-8"),
]


@pytest.mark.parametrize("argv, msg", CLI_PROBES, ids=[m[:30] for _, m in CLI_PROBES])
def test_cli_prints_one_line_for_a_user_error(cli_scratch, capsys, threads_restored, argv, msg):
    args = argv(cli_scratch)
    assert main(args + ["--no-progress"] * (args[:1] == ["generate"])) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and re.search(msg, err), err


SHIPPED = minidsa.checkpoint.PRETRAINED["default"]
DEFAULT_NAMED = [  # a command naming the shipped model "default", the same command with its config.json's path
    (["params", "default"], ["params", str(SHIPPED / "config.json")]),
    (["check-checkpoint", str(SHIPPED), "--config", "default", "--no-progress"],
     ["check-checkpoint", str(SHIPPED), "--config", str(SHIPPED / "config.json"), "--no-progress"]),
]


@pytest.mark.parametrize("by_name, by_path", DEFAULT_NAMED, ids=[a[0] for a, _ in DEFAULT_NAMED])
def test_cli_takes_default_wherever_it_takes_a_config_name(capsys, threads_restored, by_name, by_path):
    def output(argv):
        assert main(argv) == 0
        text = capsys.readouterr().out
        return re.sub(r"read in [\d.]+ s", "", text).removeprefix(f"{argv[1]}:")  # the name or path it echoes
    assert output(by_name) == output(by_path)


# ------------------------------------------------------------------ 5. leftovers
def test_resave_removes_the_shards_it_replaced(tmp_path):
    model = minidsa.load("tiny")
    (tmp_path / "notes.txt").write_text("mine")  # not a shard: a re-save must leave it alone
    for size in ("100KB", "2GB", "200KB"):
        model.save_pretrained(tmp_path, max_shard_size=size)
        on_disk = {p.name for p in tmp_path.glob("*.safetensors")}
        assert on_disk == set(weight_map(tmp_path).values()), size
    assert (tmp_path / "notes.txt").read_text() == "mine"
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(minidsa.load(tmp_path, progress=False)(ids), model(ids))


def python_blocks(text: str) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))


LEFTOVERS = [  # claim, check
    (".ci/run removes its temp folder (venv included) on any exit",
     lambda: re.search(r'work="\$\(mktemp -d\)"\ntrap \'rm -rf "\$work"\' EXIT', CI)),
    (".ci/run fails a test run that leaves files in its temp folder",
     lambda: 'TMPDIR="$work/tmp" python -m pytest -q tests' in CI and 'ls -A "$work/tmp"' in CI),
    ("the README example writes to no fixed path", lambda: "/tmp" not in python_blocks(README)),
    ("no example makes a temp folder it never removes",
     lambda: "mkdtemp" not in python_blocks(README) + "".join(nb.read_text() for nb in NOTEBOOKS)),
    ("this test run keeps its temp files in one folder that conftest removes",
     lambda: Path(tempfile.gettempdir()).name.startswith("minidsa-tests-")),
]


@pytest.mark.parametrize("claim, holds", LEFTOVERS, ids=[c for c, _ in LEFTOVERS])
def test_nothing_is_left_behind(claim, holds):
    assert holds(), claim


# ------------------------------------------------------------------ 6. the CLI's output
PRINTABLE = [  # text, as shown on a terminal
    ("plain text, é ü 中", "plain text, é ü 中"),
    ("bell\x07", "bell\\x07"),
    ("a\rb", "a\\rb"),
    ("nul\x00", "nul\\x00"),
    ("\x1b[31mred", "\\x1b[31mred"),
    ("zero\u200bwidth", "zero\\u200bwidth"),
    ("tab\tand\nnewline", "tab\tand\nnewline"),
]


@pytest.mark.parametrize("text, shown", PRINTABLE)
def test_control_characters_are_escaped_on_a_terminal(text, shown):
    assert printable(text) == shown


COUNTS = [(12, "12"), (1_000, "1 K"), (699_184, "699 K"), (30_829_088, "30.8 M"), (1_485_251_200, "1.49 B"),
          (104_368_141_056, "104 B"), (2_780_110_363_392, "2.78 T")]


@pytest.mark.parametrize("n, shown", COUNTS)
def test_parameter_counts_use_a_unit_that_fits(n, shown):
    assert human_count(n) == shown


@pytest.mark.parametrize("config", ["tiny", "laptop"])
def test_readme_parameter_figures_are_what_the_code_prints(config, capsys):
    counts = minidsa.count_parameters(config)
    figure = f"{human_count(counts['total'])} params, {human_count(counts['active'])} active"
    assert figure in README, figure


class Terminal(io.StringIO):
    """stdout as a terminal, recording each write."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty, self.writes = tty, []

    def isatty(self):
        return self.tty

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


@pytest.mark.parametrize("tty", [True, False])
def test_cli_streams_the_text_as_it_is_generated(monkeypatch, capsys, threads_restored, tty):
    out = Terminal(tty)
    monkeypatch.setattr(sys, "stdout", out)
    argv = ["generate", "hi", "--max-new-tokens", "24", "--ignore-eos", "--no-progress", "--temperature", "1"]
    assert main(argv) == 0
    text = minidsa.generate("hi", max_new_tokens=24, temperature=1.0, top_p=0.95, seed=0, stop_at_eos=False)
    assert out.getvalue() == (printable(text) if tty else text) + "\n"
    assert len([w for w in out.writes if w.strip()]) > 1  # piece by piece, not one print at the end
