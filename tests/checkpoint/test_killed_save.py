"""Saves clean up every temporary file they or safetensors made (formats/shards.py ``write_shards``): a save
killed with SIGKILL at a random moment leaves the directory loadable as the old or the new checkpoint, and
the next completed save leaves no temporary file (safetensors' ``.tmpXXXXXX`` included); a save removes the
leftovers of earlier ones before it writes, and never a file of another name or content.

The kills are real: a forked child saves two checkpoints over each other until the test sends it SIGKILL,
at a seeded random moment, either anywhere or within a shard's write (a random moment after safetensors'
temporary file appears), so that the kills reach that write every run and not only by luck."""

import multiprocessing
import os
import random
import re
import signal
import time

import pytest
import torch
from safetensors.torch import save_file

import minidsa
from minidsa.formats import shards

SEED = 1234
SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")  # safetensors' temporary file, beside its target
MIN_KILLS = 8  # kills at random moments, each followed by a load and a completed save
MAX_KILLS = 24  # ... and more, up to this many, until one has fallen inside safetensors' own write


def tensors_of(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.checkpoint_tensors().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def pair():
    """Two models of different weights and configs (28 MB, in two or four shards: each save changes the shard
    names), large enough that a shard's write lasts milliseconds."""
    base = minidsa.load_config("tiny").replace(vocab_size=50_000)
    return [(minidsa.MiniDSA(base), "15MB"), (minidsa.MiniDSA(base.replace(seed=1, max_seq_len=128)), "13MB")]


def save_forever(directory, pair, first: int) -> None:
    """The child: save the two models over each other until killed."""
    i = first
    while True:
        model, size = pair[i % 2]
        model.save_pretrained(directory, max_shard_size=size)
        i += 1


def wait_for_a_safetensors_temporary(directory, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(SAFETENSORS_TMP.fullmatch(e.name) for e in os.scandir(directory)):
        time.sleep(0.0005)


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") or p.name.endswith(".partial"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child doing save_pretrained")
@pytest.mark.slow  # a child process killed eight times or more
def test_a_save_killed_at_random_moments_leaves_a_checkpoint_and_no_temporary_after_the_next_save(tmp_path, pair):
    rng = random.Random(SEED)
    states = [tensors_of(model) for model, _ in pair]
    directory = tmp_path / "ckpt"
    pair[0][0].save_pretrained(directory, max_shard_size=pair[0][1])
    current, kills, inside_safetensors = 0, 0, 0
    fork = multiprocessing.get_context("fork")
    while kills < MIN_KILLS or (not inside_safetensors and kills < MAX_KILLS):
        child = fork.Process(target=save_forever, args=(directory, pair, 1 - current), daemon=True)
        child.start()
        if rng.random() < 0.5:   # anywhere: a save takes about 0.1 s here, so a few saves, then a moment in one
            time.sleep(rng.uniform(0.0, 0.4))
        else:   # inside a shard's write: a random moment once safetensors' temporary file is there
            wait_for_a_safetensors_temporary(directory)
            time.sleep(rng.uniform(0.0, 0.004))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        kills += 1
        left = leftovers(directory)
        inside_safetensors += any(SAFETENSORS_TMP.fullmatch(n) for n in left)
        got = minidsa.load(directory, progress=False)   # config.json, if there, must agree with the index
        loaded = tensors_of(got)
        which = next((i for i, s in enumerate(states) if same(loaded, s)), None)
        assert which is not None, f"kill {kills} (leaving {left}): the directory loads as neither checkpoint"
        assert got.config == pair[which][0].config
        model, size = pair[1 - which]
        model.save_pretrained(directory, max_shard_size=size)   # the next completed save
        assert leftovers(directory) == [], f"kill {kills}: the next save left {leftovers(directory)} (from {left})"
        assert minidsa.load_config(directory) == model.config
        current = 1 - which
    assert inside_safetensors, f"none of {kills} kills fell inside safetensors' write of a shard"


def safetensors_start(tmp_path) -> bytes:
    """The first kilobyte of a safetensors file: what a kill inside safetensors' write leaves at least."""
    path = tmp_path / "whole.safetensors"
    save_file({"x": torch.zeros(10_000)}, str(path))
    data = path.read_bytes()[:1024]
    path.unlink()
    return data


def test_a_save_removes_leftovers_first_and_never_a_users_file(tmp_path, pair, monkeypatch):
    directory = tmp_path / "ckpt"
    (model, _), (other, _) = pair[0], pair[1]
    model.save_pretrained(directory, max_shard_size="15MB")   # two shards, then four
    start = safetensors_start(tmp_path)
    stale = {  # what interrupted saves leave: ours and safetensors'
        ".tmpA1b2C3": start, ".tmpZZZZZZ": b"", ".tmp000000": b"\0" * 4096,
        ".model-00002-of-00007.safetensors.partial": start, ".model.safetensors.index.json.partial": b'{"meta',
        ".config.json.partial": b"{", ".previous-model-00003-of-00009.safetensors": start,
    }
    users = {  # names or contents that only look alike
        ".tmpA1b2C3D": start, ".tmpnotes": b"", ".tmp12345": b"", ".tmpq1w2e3": b"my notes, not tensors",
        "notes.partial": b"x", ".notes.txt.partial": b"x", ".model-1-of-2.safetensors.partial": b"x",
        "tmpA1b2C3": start, "evaluation.json": b"{}", ".previous-notes": b"x", ".previous-model.safetensors": b"x",
    }
    for name, data in {**stale, **users}.items():
        (directory / name).write_bytes(data)
    (directory / ".tmpDirect").mkdir()   # a directory of a temporary's name is no file of ours
    first_write = []
    real = shards.save_file

    def spy(*args, **kwargs):   # what the directory holds when the save writes its first shard
        if not first_write:
            first_write.append({p.name for p in directory.iterdir()})
        return real(*args, **kwargs)

    monkeypatch.setattr(shards, "save_file", spy)
    other.save_pretrained(directory, max_shard_size="13MB")
    assert not first_write[0] & set(stale), "the leftovers were still there when the save began writing"
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["config.json", shards.INDEX_NAME, ".tmpDirect", *users,
         *(f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4))])
    for name, data in users.items():
        assert (directory / name).read_bytes() == data
    assert minidsa.load_config(directory) == other.config


class Cut(Exception):
    """Stands in for an error or an interrupt inside safetensors' write (not a SafetensorError)."""


def test_a_save_after_an_interrupted_one_keeps_the_old_checkpoint_until_its_commit(tmp_path, pair, monkeypatch):
    """A save cut before its commit leaves the index pointing at the old shards' second names: the next save
    must not take those for leftovers, cut again it still leaves the old checkpoint, and completed it leaves
    nothing behind."""
    directory = tmp_path / "ckpt"
    (old, old_size), (new, new_size) = pair
    old.save_pretrained(directory, max_shard_size=old_size)
    real = shards.save_file

    def cut_inside(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        (directory / ".tmpQ9x8W7").write_bytes(b"\0" * 64)   # safetensors' temporary of a second shard
        raise Cut

    for _ in range(2):
        with monkeypatch.context() as m:
            m.setattr(shards, "save_file", cut_inside)
            with pytest.raises(Cut):
                new.save_pretrained(directory, max_shard_size=new_size)
        assert any(p.name.startswith(shards.KEPT_PREFIX) for p in directory.iterdir())
        assert leftovers(directory) == sorted(p.name for p in directory.iterdir()
                                              if p.name.startswith(shards.KEPT_PREFIX)), "temporaries left"
        assert same(tensors_of(minidsa.load(directory, progress=False)), tensors_of(old))
    new.save_pretrained(directory, max_shard_size=new_size)
    assert leftovers(directory) == []
    assert same(tensors_of(minidsa.load(directory, progress=False)), tensors_of(new))
