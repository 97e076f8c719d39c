"""One config of record: a checkpoint's config.json and the config its index embeds (written with the shards)
must agree. A difference is refused at load, reported by check-checkpoint and failed by the doctor's first
rung, each naming every differing field and which file holds which value (config.load_config,
checkpoint/validator.py, acceptance/checkpoint.py); a checkpoint with only one of the two loads from it."""

import json
import shutil

import pytest

import minidsa
from minidsa.acceptance import checkpoint as rung
from minidsa.cli import main
from minidsa.formats import shards


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    minidsa.MiniDSA("tiny").save_pretrained(path)
    return path


@pytest.fixture
def ckpt(saved_dir, tmp_path):
    """A fresh copy of a tiny checkpoint saved by save_pretrained (its index embeds the config)."""
    return shutil.copytree(saved_dir, tmp_path / "ckpt")


def edit_config_json(directory, **changes) -> None:
    """Change fields of config.json; a name like ``moe__num_experts`` reaches into a section."""
    data = json.loads((directory / "config.json").read_text())
    for dotted, value in changes.items():
        *outer, name = dotted.split("__")
        (data[outer[0]] if outer else data)[name] = value
    (directory / "config.json").write_text(json.dumps(data, indent=2))


def test_an_edited_config_json_is_refused_at_load_naming_each_field(ckpt):
    edit_config_json(ckpt, max_seq_len=128, moe__num_experts=4, moe__workspace_experts=4)
    for attempt in (lambda: minidsa.load(ckpt, progress=False), lambda: minidsa.load_config(ckpt),
                    lambda: minidsa.count_parameters(ckpt)):
        with pytest.raises(ValueError) as err:
            attempt()
        text = str(err.value)
        assert "max_seq_len (config.json: 128, index: 256)" in text
        assert "moe.num_experts (config.json: 4, index: 8)" in text
        assert "delete" in text and f"config={str(ckpt / 'config.json')!r}" in text   # how to make one win


def test_config_json_wins_when_passed_explicitly_and_a_save_makes_it_the_record(ckpt):
    edit_config_json(ckpt, max_seq_len=128)   # still fits the weights: only the refusal stands in the way
    model = minidsa.load(ckpt, progress=False, config=ckpt / "config.json")
    assert model.config.max_seq_len == 128
    model.save_pretrained(ckpt)
    assert minidsa.load(ckpt, progress=False).config.max_seq_len == 128
    assert minidsa.check_checkpoint(ckpt, progress=False).ok


def test_the_index_config_wins_when_config_json_is_deleted(ckpt):
    edit_config_json(ckpt, max_seq_len=128)
    (ckpt / "config.json").unlink()
    assert minidsa.load(ckpt, progress=False).config.max_seq_len == 256
    assert minidsa.check_checkpoint(ckpt, progress=False).ok


def test_a_checkpoint_with_config_json_alone_loads_as_older_minidsa_wrote_it(ckpt):
    index = ckpt / shards.INDEX_NAME
    data = json.loads(index.read_text())
    del data["metadata"]["config"]
    index.write_text(json.dumps(data))
    edit_config_json(ckpt, max_seq_len=128)   # the only config, so the one of record
    assert minidsa.load(ckpt, progress=False).config.max_seq_len == 128
    assert minidsa.check_checkpoint(ckpt, progress=False).ok


def test_config_json_of_16_experts_beside_8_expert_weights_is_a_check_checkpoint_finding(ckpt, capsys):
    edit_config_json(ckpt, moe__num_experts=16)
    report = minidsa.check_checkpoint(ckpt, progress=False)
    assert not report.ok
    assert [(f.kind, f.shard, f.name) for f in report.findings] == [("config", "config.json", "moe.num_experts")]
    assert report.findings[0].detail.startswith("16 in config.json, 8 in model.safetensors.index.json")
    assert "minidsa.load refuses the checkpoint until one wins" in str(report)
    # checked against an explicitly named config, the directory's disagreement is still reported
    explicit = minidsa.check_checkpoint(ckpt, "tiny", progress=False)
    assert [f.kind for f in explicit.findings] == ["config"]
    assert main(["check-checkpoint", str(ckpt), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "moe.num_experts: 16 in config.json, 8 in model.safetensors.index.json" in out
    assert "OK: no findings" not in out


def test_the_doctors_first_rung_fails_on_it(ckpt):
    edit_config_json(ckpt, moe__num_experts=16, max_seq_len=128)
    gate, model = rung.check(str(ckpt), "cpu")
    assert gate.status == "FAIL" and model is None
    assert any("moe.num_experts: 16 in config.json, 8 in" in line for line in gate.details)
    assert any("max_seq_len: 128 in config.json, 256 in" in line for line in gate.details)
    assert "delete" in gate.look_at and "config=" in gate.look_at


def test_a_malformed_config_json_beside_a_valid_index_is_refused_with_the_fix(ckpt):
    (ckpt / "config.json").write_text('{"hidden_size": 64,,}')
    with pytest.raises(ValueError, match=r"malformed config JSON in .*config.json.*embeds a valid config.*delete"):
        minidsa.load(ckpt, progress=False)
    gate, _ = rung.check(str(ckpt), "cpu")
    assert gate.status == "FAIL" and "malformed config JSON" in gate.measured
    report = minidsa.check_checkpoint(ckpt, "tiny", progress=False)   # a config named: a finding, not an error
    assert [f.kind for f in report.findings] == ["config"]


def test_config_is_for_checkpoint_directories_only():
    with pytest.raises(ValueError, match="config= chooses the config of a checkpoint directory"):
        minidsa.load("tiny", config="tiny")


def test_the_shipped_checkpoint_passes():
    assert minidsa.check_checkpoint("default", progress=False).ok
    gate, model = rung.check("default", "cpu")
    assert gate.status == "PASS" and model is not None
