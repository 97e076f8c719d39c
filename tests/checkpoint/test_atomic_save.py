"""Saving over a checkpoint is safe to interrupt: cut at every write and rename, the directory loads as the
old checkpoint or as the new one, never as neither (formats/shards.py ``write_shards``)."""

import json
import os

import pytest
import torch

import minidsa
from minidsa.formats import shards


class Cut(Exception):
    """Stands in for a kill or a full disk at one point of a save."""


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.checkpoint_tensors().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def models():
    old = minidsa.MiniDSA("tiny")
    new = minidsa.MiniDSA(minidsa.load_config("tiny").replace(seed=1, rms_norm_eps=1e-6))  # other weights and config
    return old, new


def cut_at(monkeypatch, k: int) -> list:
    """Make the k-th file operation of a save (a shard write, a rename, a link) raise Cut."""
    calls = []

    def counted(real):
        def run(*args, **kwargs):
            calls.append(real.__name__)
            if len(calls) == k + 1:
                raise Cut(f"cut at operation {k} ({real.__name__})")
            return real(*args, **kwargs)
        return run

    monkeypatch.setattr(shards, "save_file", counted(shards.save_file))
    monkeypatch.setattr(shards.os, "replace", counted(os.replace))
    monkeypatch.setattr(shards.os, "link", counted(os.link))
    return calls


def without_embedded_config(directory) -> None:
    """Rewrite the index as minidsa wrote it before it embedded the config (config.json alone held it)."""
    index = directory / shards.INDEX_NAME
    data = json.loads(index.read_text())
    del data["metadata"]["config"]
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("embedded", [True, False], ids=["index-with-config", "older-index-without"])
def test_a_save_cut_anywhere_leaves_the_old_or_the_new_checkpoint(tmp_path, models, monkeypatch, embedded):
    old, new = models
    old_state, new_state = state(old), state(new)
    seen = set()
    for k in range(40):
        d = tmp_path / f"cut{k}"
        old.save_pretrained(d, max_shard_size="1MB")   # three shards
        if not embedded:
            without_embedded_config(d)
        with monkeypatch.context() as m:
            calls = cut_at(m, k)
            try:
                new.save_pretrained(d, max_shard_size="600KB")
                finished = True
            except Cut:
                finished = False
        got = minidsa.load(d, progress=False)   # refused if config.json and the index's config differ
        loaded = state(got)
        assert same(loaded, old_state) or same(loaded, new_state), f"cut at {k}: neither checkpoint"
        is_new = same(loaded, new_state)
        assert got.config == (new.config if is_new else old.config)
        left = [p.name for p in d.iterdir() if p.name.endswith(".partial") or p.name.startswith(".tmp")]
        assert not left, f"cut at {k}: the failed save left its temporary files {left}"
        seen.add("new" if is_new else "old")
        if finished:
            assert len(calls) <= k and is_new
            break
    assert seen == {"old", "new"}   # the cuts fell before and after the commit


def test_a_finished_save_leaves_no_second_names_or_partial_files(tmp_path, models):
    old, new = models
    old.save_pretrained(tmp_path, max_shard_size="1MB")
    (tmp_path / "notes.txt").write_text("mine")   # a user's own file stays
    new.save_pretrained(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "notes.txt"]
    assert minidsa.load_config(tmp_path) == new.config


def test_a_stale_config_json_is_refused_not_ignored(tmp_path, models):
    """What older minidsa left when cut between its commit and config.json: one of the two must win explicitly."""
    old, new = models
    new.save_pretrained(tmp_path)
    old.config.to_json(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"differ in rms_norm_eps \(config.json: 1e-05, index: 1e-06\), seed"):
        minidsa.load(tmp_path, progress=False)
    (tmp_path / "config.json").unlink()   # the index's config wins
    assert same(state(minidsa.load(tmp_path, progress=False)), state(new))


def test_a_save_that_cannot_write_is_an_oserror_naming_the_path(tmp_path, models):
    old, _ = models
    target = tmp_path / "ro"
    old.save_pretrained(target)
    target.chmod(0o500)   # read-only directory
    try:
        if os.access(target, os.W_OK):
            pytest.skip("running as a user who may write anywhere")
        with pytest.raises(OSError) as err:
            old.save_pretrained(target)
        assert str(target) in str(err.value)
    finally:
        target.chmod(0o700)
    assert same(state(minidsa.load(target, progress=False)), state(old))


def test_a_failed_shard_write_is_an_oserror_and_keeps_the_old_checkpoint(tmp_path, models, monkeypatch):
    from safetensors import SafetensorError
    old, new = models
    old.save_pretrained(tmp_path)

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(shards, "save_file", full)
    with pytest.raises(OSError, match="cannot write shard model-00001-of-00001.safetensors") as err:
        new.save_pretrained(tmp_path)
    assert err.value.filename.startswith(str(tmp_path))
    monkeypatch.undo()
    assert same(state(minidsa.load(tmp_path, progress=False)), state(old))
