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


# Reference-scale tensor shapes of docs/design.md §5 (and §9 names); A_log is stored padded to 128.
KDA_SHAPES = {"q_proj.weight": (12288, 7168), "k_proj.weight": (12288, 7168), "v_proj.weight": (12288, 7168),
              "q_conv1d.weight": (12288, 1, 4), "f_a_proj.weight": (128, 7168), "f_b_proj.weight": (12288, 128),
              "A_log": (128,), "dt_bias": (12288,), "b_proj.weight": (96, 7168), "g_proj.weight": (12288, 7168),
              "o_norm.weight": (128,), "o_proj.weight": (7168, 12288)}
MLA_SHAPES = {"q_a_proj.weight": (1536, 7168), "q_a_layernorm.weight": (1536,), "q_b_proj.weight": (18432, 1536),
              "kv_a_proj_with_mqa.weight": (576, 7168), "kv_a_layernorm.weight": (512,),
              "kv_b_proj.weight": (24576, 512), "g_proj.weight": (12288, 7168), "o_proj.weight": (7168, 12288),
              "indexer.wq_b.weight": (4096, 1536), "indexer.wk.weight": (128, 7168), "indexer.k_norm.weight": (128,),
              "indexer.k_norm.bias": (128,), "indexer.weights_proj.weight": (32, 7168)}


def test_reference_config_builds_on_meta_device_with_spec_shapes():
    model = minidsa.MiniDSA(load_config("k3.1-pro"), device="meta")
    assert model.device.type == "meta"
    params = dict(model.named_parameters())
    for layer, kind in [(0, KDA_SHAPES), (3, MLA_SHAPES), (91, MLA_SHAPES), (92, MLA_SHAPES), (90, KDA_SHAPES)]:
        for name, shape in kind.items():
            full = f"language_model.model.layers.{layer}.self_attn.{name}"
            assert tuple(params[full].shape) == shape, full
    for mixer in ("self_attention_res", "mlp_res"):
        assert tuple(params[f"language_model.model.layers.5.{mixer}_proj.weight"].shape) == (1, 7168)
        assert tuple(params[f"language_model.model.layers.5.{mixer}_norm.weight"].shape) == (7168,)
    assert tuple(params["language_model.lm_head.weight"].shape) == (163840, 7168)
    assert params["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32  # fp32 in a bf16 model
    assert params["language_model.model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


@pytest.mark.slow  # builds and installs a wheel
def test_every_package_folder_ships_in_the_wheel():
    """pyproject lists the packages by hand: a new folder left out imports from the tree but not from a wheel."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "minidsa").rglob("__init__.py")}
    assert folders - listed == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {folders - listed}"


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
