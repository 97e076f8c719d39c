import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import minidsa
from minidsa.config import ModelConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_presets_load_and_keep_the_mechanisms():
    assert {"tiny", "laptop", "small", "k3.1-pro"} <= set(minidsa.preset_names())
    for name in ["tiny", "laptop", "small"]:
        cfg = load_config(name)
        assert cfg.layer_types[-1] == "mla"
        assert cfg.indexer.topk < cfg.max_seq_len, "sparsity must be real"
        assert cfg.kv_block_size < cfg.max_seq_len, "paging must be real"
        assert cfg.moe.num_experts > cfg.moe.top_k


def test_reference_scale_config_matches_spec_section_0():
    cfg = load_config("k3.1-pro")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (163840, 7168, 93)
    expected_mla = list(range(3, 92, 4)) + [92]
    assert cfg.mla_layers == expected_mla and len(expected_mla) == 24
    assert cfg.layer_types.count("kda") == 69
    m, ix = cfg.mla, cfg.indexer
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == \
        (96, 1536, 512, 128, 64, 128)
    assert (ix.num_heads, ix.head_dim, ix.topk) == (32, 128, 2048)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.latent_size) == (896, 16, 3584)
    assert cfg.dense_intermediate_size == 33792 and cfg.attn_res_block_size == 12


def test_load_by_path_and_dict(tmp_path):
    cfg = load_config("tiny")
    p = tmp_path / "c.json"
    cfg.to_json(p)
    assert load_config(p) == cfg
    assert load_config(str(p)) == cfg
    assert load_config(cfg.to_dict()) == cfg
    (tmp_path / "ckpt").mkdir()
    cfg.to_json(tmp_path / "ckpt" / "config.json")
    assert load_config(tmp_path / "ckpt") == cfg


def test_unknown_name_lists_presets():
    with pytest.raises(ValueError, match=r"unknown config name 'tinyy'.*tiny"):
        load_config("tinyy")
    with pytest.raises(ValueError, match="does not exist"):
        load_config("missing/dir/x.json")


def test_malformed_json_is_named(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"hidden_size": 64,,}')
    with pytest.raises(ValueError, match="malformed config JSON"):
        load_config(p)
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_config(p)


@pytest.mark.parametrize("patch, field", [
    ({"hidden_size": 0}, "hidden_size"),
    ({"hidden_size": 3.5}, "hidden_size"),
    ({"mla": {"kv_lora_rank": -1}}, "mla.kv_lora_rank"),
    ({"indexer": {"topk": 0}}, "indexer.topk"),
    ({"indexer": {"head_dim": 24, "fp8": True, "hadamard": True}}, "indexer.head_dim"),
    ({"moe": {"top_k": 99}}, "moe.top_k"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"kv_block_size": 1000}, "kv_block_size"),
    ({"dtype": "float16"}, "dtype"),
    ({"layer_types": ["mla", "attn"]}, r"layer_types\[1\]"),
    ({"layer_types": ["mla", "kda"]}, "end with an 'mla'"),
    ({"layer_types": []}, "layer_types"),
    ({"hidden_sise": 64}, "hidden_sise"),
    ({"mla": {"heads": 4}}, "mla.*heads"),
    ({"indexer": {"fp8": "yes"}}, "indexer.fp8"),
])
def test_bad_fields_are_named(patch, field):
    data = load_config("tiny").to_dict()
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k].update(v)
        else:
            data[k] = v
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(data)


def test_reference_config_builds_on_meta_only_device():
    # The full 93-layer pattern has KDA layers, which this version cannot build; an all-MLA slice of
    # the reference widths must build on "meta" without allocating memory.
    cfg = load_config("k3.1-pro").replace(layer_types=["mla"] * 2)
    model = minidsa.MiniDSA(cfg, device="meta")
    assert model.device.type == "meta"
    assert model.num_parameters() > 3_000_000_000  # embeddings + lm_head alone are 2.3 B
    with pytest.raises(ValueError, match="KDA"):
        minidsa.MiniDSA(load_config("k3.1-pro"), device="meta")


def test_presets_load_from_an_installed_wheel(tmp_path):
    """load('tiny') must work from a wheel, outside the source tree."""
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(ROOT)], check=True, capture_output=True)
    (whl,) = wheel_dir.glob("minidsa-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    code = ("import minidsa, sys; c = minidsa.load_config('tiny'); "
            "print(minidsa.__file__); print(c.name, c.hidden_size)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""},
                         check=True, capture_output=True, text=True).stdout.split("\n")
    assert out[0].startswith(str(site)), out
    assert out[1] == f"tiny {load_config('tiny').hidden_size}"
