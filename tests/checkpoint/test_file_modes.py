"""Files a save writes get the mode open() gives any new file, 0o666 less the process umask: shards and the
training state as well as config.json and the index, although safetensors creates its files 0600 (another
user loading the checkpoint would otherwise get PermissionError on the first shard)."""

import os
import stat

import pytest
import torch

import minidsa
from minidsa.training.state import STATE_FILE, save_state


def modes(directory) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}


@pytest.fixture(params=[0o022, 0o027, 0o002], ids=["umask-022", "umask-027", "umask-002"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_every_file_of_a_checkpoint_gets_the_mode_of_the_umask(tmp_path, umask):
    model = minidsa.MiniDSA("tiny")
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="1MB")   # three shards
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="1MB")   # over an old checkpoint: the same
    found = modes(tmp_path / "ckpt")
    assert len(found) == 5
    assert found == {name: 0o666 & ~umask for name in found}, {n: oct(m) for n, m in found.items()}


def test_a_leftover_temporary_does_not_lend_its_mode(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    leftover = directory / ".model-00001-of-00001.safetensors.partial"
    leftover.write_bytes(b"")
    leftover.chmod(0o600)
    old = os.umask(0o022)
    try:
        minidsa.MiniDSA("tiny").save_pretrained(directory)
    finally:
        os.umask(old)
    assert set(modes(directory).values()) == {0o644}


def test_the_training_state_gets_the_mode_of_the_umask(tmp_path, umask):
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight])
    weight.sum().backward()
    optimizer.step()
    save_state(tmp_path / STATE_FILE, {"w": weight.detach()}, optimizer.state_dict(), 1,
               {"history": [], "evals": [], "train_config": {}})
    assert modes(tmp_path) == {STATE_FILE: 0o666 & ~umask}
