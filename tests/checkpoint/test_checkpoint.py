"""save_pretrained -> load: real names and formats, exact round trip, and every kind of damage
reported by name."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import minidsa
from minidsa.checkpoint import DEFAULT_MODEL, PRETRAINED
from minidsa.formats.shards import file_checksum

INDEX = "model.safetensors.index.json"
SHIPPED = PRETRAINED[DEFAULT_MODEL]  # the trained checkpoint load("default") reads


def copy_of(saved, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(saved[1], dst)
    return dst


def test_layout_names_and_dtypes(saved):
    model, path = saved
    index = json.loads((path / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (path / "config.json").is_file()
    wm = index["weight_map"]
    cfg = model.config
    e = cfg.moe.num_experts - 1
    packed = f"language_model.model.layers.1.block_sparse_moe.experts.{e}.w1.weight_packed"
    scale = f"language_model.model.layers.1.block_sparse_moe.experts.{e}.w2.weight_scale"
    with safe_open(str(path / wm[packed]), "pt") as f:
        t = f.get_tensor(packed)
        assert t.dtype == torch.uint8 and tuple(t.shape) == (cfg.moe.expert_intermediate_size, cfg.moe.latent_size // 2)
    with safe_open(str(path / wm[scale]), "pt") as f:
        t = f.get_tensor(scale)
        assert t.dtype == torch.uint8 and tuple(t.shape) == (cfg.moe.latent_size, cfg.moe.expert_intermediate_size // 32)
    for name in ["language_model.lm_head.weight", "language_model.model.layers.3.self_attn.indexer.k_norm.bias",
                 "language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                 "language_model.model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
                 "language_model.model.layers.1.block_sparse_moe.routed_expert_up_proj.weight",
                 "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight",
                 "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
                 "language_model.model.layers.2.self_attention_res_proj.weight",
                 "language_model.model.layers.2.mlp_res_norm.weight", "language_model.model.layers.0.mlp.up_proj.weight"]:
        assert name in wm, name
    assert not any(k.endswith(("w1_packed", "w1_scale")) for k in wm)  # stacked buffers never leak into files
    assert index["metadata"]["total_size"] > 0


def test_round_trip_is_exact(saved):
    model, path = saved
    loaded = minidsa.load(path)
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())
    out = minidsa.generate("hi", loaded, max_new_tokens=5, temperature=0, stop_at_eos=False)
    assert out == minidsa.generate("hi", model, max_new_tokens=5, temperature=0, stop_at_eos=False)


def test_missing_shard(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    (path / "model-00002-of-" f"{len(list(path.glob('*.safetensors'))):05d}.safetensors").unlink()
    with pytest.raises(ValueError, match=r"shard model-00002-of-\d+\.safetensors .* missing"):
        minidsa.load(path)


def rewrite_shard_of(path, name, change):
    """Apply ``change(tensors, index)`` to the shard holding ``name`` and re-record its checksum, as a tool
    that writes valid safetensors would: what is then caught is the damage itself, not the checksum."""
    index = json.loads((path / INDEX).read_text())
    fname = index["weight_map"][name]
    tensors = load_file(str(path / fname))
    change(tensors, index)
    save_file(tensors, str(path / fname))
    index["metadata"]["checksums"][fname] = file_checksum(path / fname)
    (path / INDEX).write_text(json.dumps(index))


def test_missing_tensor(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    name = "language_model.model.layers.4.self_attn.A_log"

    def drop(tensors, index):
        del tensors[name]
        del index["weight_map"][name]
    rewrite_shard_of(path, name, drop)
    with pytest.raises(ValueError, match="missing 1 tensor.*layers.4.self_attn.A_log"):
        minidsa.load(path)


def test_tensor_listed_but_absent_from_shard(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    name = "language_model.model.norm.weight"
    rewrite_shard_of(path, name, lambda tensors, index: tensors.pop(name))
    with pytest.raises(ValueError, match="language_model.model.norm.weight .* shard lacks it"):
        minidsa.load(path)


DAMAGED_TENSORS = [  # tensor, how it is damaged, what the error must say
    ("language_model.model.layers.3.self_attn.kv_b_proj.weight", lambda t: t[:-1].clone(),
     r"kv_b_proj.weight has shape .* expected"),
    ("language_model.model.layers.1.block_sparse_moe.experts.0.w3.weight_packed", lambda t: t.to(torch.int16),
     r"experts.0.w3.weight_packed has dtype torch.int16, expected torch.uint8"),
    ("language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_scale",
     lambda t: t.index_fill(1, torch.tensor([0]), 0xFF), r"experts.5.w2.weight_scale holds the E8M0 NaN code 0xFF"),
]


@pytest.mark.parametrize("name, damage, msg", DAMAGED_TENSORS, ids=["shape", "dtype", "e8m0_nan"])
def test_damaged_tensor_is_named(saved, tmp_path, name, damage, msg):
    path = copy_of(saved, tmp_path)

    def apply(tensors, index):
        tensors[name] = damage(tensors[name])
    rewrite_shard_of(path, name, apply)
    with pytest.raises(ValueError, match=msg):
        minidsa.load(path)


def test_truncated_shard(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    shard = sorted(path.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=shard.name):
        minidsa.load(path)


def test_unexpected_tensor_and_bad_index(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    name = "language_model.model.norm.weight"

    def extra(tensors, index):
        tensors["language_model.model.layers.99.extra"] = torch.zeros(1)
        index["weight_map"]["language_model.model.layers.99.extra"] = index["weight_map"][name]
    rewrite_shard_of(path, name, extra)
    with pytest.raises(ValueError, match="layers.99.extra"):
        minidsa.load(path)
    (path / INDEX).write_text("{ nope")
    with pytest.raises(ValueError, match="malformed"):
        minidsa.load(path)
    (path / INDEX).unlink()
    with pytest.raises(ValueError, match="not a minidsa checkpoint"):
        minidsa.load(path)


def test_bad_shard_size(tmp_path):
    with pytest.raises(ValueError, match="max_shard_size"):
        minidsa.load("tiny").save_pretrained(tmp_path / "unused", max_shard_size="lots")
    assert not (tmp_path / "unused").exists()  # checked before anything is written


def test_reference_scale_parameter_counts():
    counts = minidsa.count_parameters("k3.1-pro")  # meta device: no memory
    # 2.7799 T is the sum over the released checkpoint's shapes (the card rounds it to 2.8 T); ours differs by the
    # DSA indexer of K3.1 (178.5 M parameters, 0.006 %) and may differ by no more than 0.1 %
    assert abs(counts["total"] / 2.7799e12 - 1) < 1e-3
    # the card's 104 B (104.2 B) leaves out the input embedding and the vision path; 0.5 % allows for the card's rounding
    assert abs(counts["active"] / 104.2e9 - 1) < 5e-3
    # what the other definition adds, worked out from the reference shapes (docs/design.md §0, §8)
    embedding = 163840 * 7168
    block = 2 * 1024 + 3 * 1536 * 1024 + 1024 * 1536 + 2 * 4096 * 1024  # norm0, norm1, wqkv, wo, fc0, fc1
    tower = 1024 * 3 * 14 * 14 + 64 * 64 * 1024 + 27 * block + 1024  # patch conv, position grid, blocks, final norm
    projector = 4096 * 4096 + 4096 * 7168 + 7168
    assert counts["active_with_embedding_and_vision"] - counts["active"] == embedding + tower + projector
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for key in counts:  # the README quotes the figures `python -m minidsa params k3.1-pro` prints
        assert f"{counts[key]:,}" in readme, key


def test_params_cli(capsys):
    from minidsa.cli import main
    assert main(["params", "tiny"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny:") and "active per token" in out
    assert main(["params", "nope"]) == 2


def test_default_names_the_shipped_model_wherever_a_config_name_is_taken(capsys):
    """"default" is what load("default") loads: the counts, the manifest and the random model of its name are
    those of the shipped config.json, and the validator checks against it."""
    trained = minidsa.load("default", progress=False)
    shipped = SHIPPED / "config.json"
    counts = minidsa.count_parameters("default")
    assert counts == minidsa.count_parameters(shipped)
    packed = sum(m.experts.packed.numel() * 2 for m in trained.moe_layers())  # two MXFP4 elements a byte
    assert counts["total"] == sum(p.numel() for p in trained.parameters()) + packed
    assert minidsa.build_model("default").config == trained.config
    manifest = minidsa.checkpoint_manifest("default")
    assert manifest == minidsa.checkpoint_manifest(shipped)
    assert {n: tuple(t.shape) for n, t in trained.checkpoint_tensors().items()} == {n: s for n, (s, _) in manifest.items()}
    report = minidsa.check_checkpoint(SHIPPED, "default", progress=False)
    assert report.ok and report.tensors == len(manifest), str(report)
    from minidsa.cli import main
    assert main(["params", "default"]) == 0
    by_name = capsys.readouterr().out
    assert main(["params", str(shipped)]) == 0
    assert by_name.removeprefix("default:") == capsys.readouterr().out.removeprefix(f"{shipped}:")


def test_lazy_experts_are_read_on_first_use(saved, tmp_path):
    model, path = saved
    lazy = minidsa.load(path, lazy_experts=True)
    assert lazy.expert_stats()["experts_resident"] == 0
    ids = torch.randint(0, 256, (1, 1))
    with torch.no_grad():
        out = lazy(ids)
        ref = model(ids)
    assert torch.equal(out, ref)
    n_moe = len(lazy.moe_layers())
    assert lazy.expert_stats()["experts_resident"] == n_moe * model.config.moe.top_k
    ids = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        assert torch.equal(lazy(ids), model(ids))
    again = tmp_path / "again"
    lazy.save_pretrained(again)  # reads the rest first
    assert lazy.expert_stats()["experts_resident"] == n_moe * model.config.moe.num_experts
    with torch.no_grad():
        assert torch.equal(minidsa.load(again)(ids), model(ids))


def test_lazy_expert_with_nan_scale_fails_by_name_on_use(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    names = [f"language_model.model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight_scale"
             for i in range(1, 9) for e in range(8)]

    def poison_all(tensors, index):
        for n in names:
            if n in tensors:
                tensors[n][0, 0] = 0xFF
    index = json.loads((path / INDEX).read_text())
    for fname in sorted({index["weight_map"][n] for n in names}):
        first = next(n for n in names if index["weight_map"][n] == fname)
        rewrite_shard_of(path, first, poison_all)
    lazy = minidsa.load(path, lazy_experts=True)  # headers are fine
    for _ in range(2):  # the failure is repeatable: nothing about the expert was forgotten
        with pytest.raises(ValueError, match=r"experts\.\d+\.w1\.weight_scale holds the E8M0 NaN code 0xFF"):
            with torch.no_grad():
                lazy(torch.randint(0, 256, (1, 3)))
    with pytest.raises(ValueError, match="0xFF"):
        minidsa.load(path)  # eager loading rejects it up front


def test_lazy_experts_refuse_a_shard_replaced_after_load(tmp_path):
    from minidsa.formats.shards import CheckpointChangedError
    path = tmp_path / "ckpt"
    minidsa.MiniDSA("tiny").save_pretrained(path)
    lazy = minidsa.load(path, lazy_experts=True, progress=False)
    minidsa.MiniDSA(minidsa.load_config("tiny").replace(seed=5)).save_pretrained(path)   # replaced under it
    with pytest.raises(CheckpointChangedError, match="changed on disk after the model was loaded") as err:
        with torch.no_grad():
            lazy(torch.tensor([[5, 6, 7]]))
    assert isinstance(err.value, OSError) and err.value.filename.endswith(".safetensors")


@pytest.mark.parametrize("field", ["attn_res_block_size", "max_seq_len", "indexer.topk"])
def test_a_config_json_missing_a_field_that_changes_the_model_is_refused(tmp_path, field):
    import json
    path = tmp_path / "ckpt"
    minidsa.MiniDSA("tiny").save_pretrained(path)
    for name in ("config.json", "model.safetensors.index.json"):   # the index embeds the config too
        data = json.loads((path / name).read_text())
        cfg = json.loads(data["metadata"]["config"]) if name != "config.json" else data
        outer, _, inner = field.rpartition(".")
        del (cfg[outer] if outer else cfg)[inner]
        if name == "config.json":
            data = cfg
        else:
            data["metadata"]["config"] = json.dumps(cfg)
        (path / name).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"lacks the config field\\(s\\) {field};"):
        minidsa.load(path, progress=False)


def test_a_config_json_may_leave_out_the_documented_defaults(tmp_path):
    import json
    path = tmp_path / "c.json"
    data = minidsa.load_config("tiny").to_dict()
    for key in ("seed", "kv_num_blocks", "rms_norm_eps"):
        del data[key]
    path.write_text(json.dumps(data))
    assert minidsa.load_config(path).rms_norm_eps == minidsa.ModelConfig().rms_norm_eps


def test_a_tensor_the_index_does_not_list_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    path = tmp_path / "ckpt"
    minidsa.MiniDSA("tiny").save_pretrained(path)
    shard = path / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    tensors["language_model.model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(tensors, shard)
    index = path / "model.safetensors.index.json"
    import json
    data = json.loads(index.read_text())
    data["metadata"]["checksums"] = {}   # so the checksum does not catch it first
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="holds 1 tensor\\(s\\) that model.safetensors.index.json does not list"):
        minidsa.load(path, progress=False)
