"""The checkpoint manifest and the Day-0 validator (docs/design.md §9): the manifest is what save_pretrained
writes and, at reference scale, the released checkpoint's names, shapes and on-disk dtypes; clean checkpoints
pass; every kind of damage is found by name; a header-only copy of the reference manifest is checked fast."""

import json
import math
import os
import shutil
import time

import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file, save_file

import minidsa
from minidsa.cli import main
from minidsa.formats.shards import ITEM_BYTES, file_checksum, read_header

INDEX = "model.safetensors.index.json"
P = "language_model.model.layers."


@pytest.fixture(scope="module")
def saved(saved):
    """conftest's saved checkpoint; here only its directory."""
    return saved[1]


def copy_of(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def on_disk(path) -> dict:
    """{name: (shape, dtype)} of every tensor in the shards, read from their headers."""
    out = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        header, _ = read_header(shard)
        out.update({n: (tuple(e["shape"]), e["dtype"]) for n, e in header.items()})
    return out


# ------------------------------------------------------------------------------------------ the manifest
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_manifest_is_what_save_pretrained_writes(tmp_path, dtype):
    model = minidsa.MiniDSA(tiny_config(dtype=dtype))
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    manifest = minidsa.checkpoint_manifest(model.config)
    assert on_disk(tmp_path) == manifest
    assert set(json.loads((tmp_path / INDEX).read_text())["weight_map"]) == set(manifest)
    gate = f"{P}1.block_sparse_moe.gate.weight"
    assert model.get_parameter(gate).dtype == torch.float32  # computed in fp32 ...
    assert manifest[gate][1] == {"float32": "F32", "bfloat16": "BF16"}[dtype]  # ... stored in the model dtype
    assert manifest[f"{P}0.self_attn.A_log"] == ((128,), "F32")
    loaded = minidsa.load(tmp_path, progress=False)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():  # exact: an fp32 copy of a BF16-on-disk weight already holds bf16 values
        assert torch.equal(loaded(ids), model(ids))


# Released K3.1 tensors (docs/design.md §5, §9): (name under language_model.model., shape, on-disk dtype).
REFERENCE = [
    ("embed_tokens.weight", (163840, 7168), "BF16"), ("norm.weight", (7168,), "BF16"),
    ("output_attn_res_norm.weight", (7168,), "BF16"), ("output_attn_res_proj.weight", (1, 7168), "BF16"),
    ("layers.0.mlp.gate_proj.weight", (33792, 7168), "BF16"), ("layers.0.mlp.down_proj.weight", (7168, 33792), "BF16"),
    ("layers.0.self_attention_res_norm.weight", (7168,), "BF16"), ("layers.5.mlp_res_proj.weight", (1, 7168), "BF16"),
    ("layers.0.self_attn.q_proj.weight", (12288, 7168), "BF16"), ("layers.0.self_attn.q_conv1d.weight", (12288, 1, 4), "F32"),
    ("layers.0.self_attn.f_a_proj.weight", (128, 7168), "BF16"), ("layers.0.self_attn.f_b_proj.weight", (12288, 128), "BF16"),
    ("layers.0.self_attn.A_log", (128,), "F32"), ("layers.0.self_attn.dt_bias", (12288,), "F32"),
    ("layers.0.self_attn.b_proj.weight", (96, 7168), "BF16"), ("layers.0.self_attn.g_proj.weight", (12288, 7168), "BF16"),
    ("layers.0.self_attn.o_norm.weight", (128,), "F32"), ("layers.0.self_attn.o_proj.weight", (7168, 12288), "BF16"),
    ("layers.92.self_attn.q_a_proj.weight", (1536, 7168), "BF16"), ("layers.92.self_attn.q_a_layernorm.weight", (1536,), "BF16"),
    ("layers.92.self_attn.q_b_proj.weight", (18432, 1536), "BF16"),
    ("layers.92.self_attn.kv_a_proj_with_mqa.weight", (576, 7168), "BF16"),
    ("layers.92.self_attn.kv_a_layernorm.weight", (512,), "BF16"), ("layers.92.self_attn.kv_b_proj.weight", (24576, 512), "BF16"),
    ("layers.92.self_attn.g_proj.weight", (12288, 7168), "BF16"), ("layers.92.self_attn.o_proj.weight", (7168, 12288), "BF16"),
    ("layers.1.block_sparse_moe.gate.weight", (896, 7168), "BF16"),
    ("layers.1.block_sparse_moe.gate.e_score_correction_bias", (896,), "F32"),
    ("layers.1.block_sparse_moe.routed_expert_down_proj.weight", (3584, 7168), "BF16"),
    ("layers.1.block_sparse_moe.routed_expert_up_proj.weight", (7168, 3584), "BF16"),
    ("layers.1.block_sparse_moe.routed_expert_norm.weight", (3584,), "BF16"),
    ("layers.1.block_sparse_moe.shared_experts.gate_proj.weight", (6144, 7168), "BF16"),
    ("layers.1.block_sparse_moe.shared_experts.down_proj.weight", (7168, 6144), "BF16"),
    ("layers.92.block_sparse_moe.experts.895.w1.weight_packed", (3072, 1792), "U8"),
    ("layers.92.block_sparse_moe.experts.895.w3.weight_scale", (3072, 112), "U8"),
    ("layers.1.block_sparse_moe.experts.0.w2.weight_packed", (3584, 1536), "U8"),
    ("layers.1.block_sparse_moe.experts.0.w2.weight_scale", (3584, 96), "U8"),
]


@pytest.mark.slow  # the reference-scale manifest
def test_reference_manifest_matches_the_release():
    manifest = minidsa.checkpoint_manifest("k3.1-pro")  # meta device
    for name, shape, dtype in REFERENCE:
        assert manifest["language_model.model." + name] == (shape, dtype), name
    assert manifest["language_model.lm_head.weight"] == ((163840, 7168), "BF16")
    # The released checkpoint holds 497,220 tensors; K3.1 adds the DSA indexer's 5 tensors in each of 24 MLA layers.
    indexer = [n for n in manifest if ".self_attn.indexer." in n]
    assert len(indexer) == 24 * 5 and len(manifest) - len(indexer) == 497_220
    vision = {n: v for n, v in manifest.items() if n.startswith(("vision_tower.", "mm_projector."))}
    assert vision["vision_tower.encoder.blocks.26.wqkv.weight"] == ((3 * 1536, 1024), "BF16")
    assert vision["vision_tower.patch_embed.pos_emb.weight"] == ((64, 64, 1024), "BF16")
    assert vision["mm_projector.proj.2.weight"] == ((7168, 4096), "BF16")
    assert len(vision) == 2 + 27 * 6 + 1 + 3


# -------------------------------------------------------------------------------- checkpoints on disk
def test_clean_checkpoint_has_no_findings(saved):
    report = minidsa.check_checkpoint(saved, progress=False)
    assert report.ok and report.findings == [], str(report)
    assert report.tensors == len(minidsa.checkpoint_manifest("tiny")) and report.shards > 1
    assert str(report).endswith("OK: no findings")


def rewrite(path, name, change):
    """Load the shard holding ``name``, let change(tensors, weight_map) edit it, write shard and index back
    (with the shard's new checksum, so that what a load catches is the damage itself)."""
    index = json.loads((path / INDEX).read_text())
    fname = index["weight_map"][name]
    tensors = load_file(str(path / fname))
    change(tensors, index["weight_map"])
    save_file(tensors, str(path / fname), metadata={"format": "pt"})
    index["metadata"]["checksums"][fname] = file_checksum(path / fname)
    (path / INDEX).write_text(json.dumps(index))
    return fname


def shard_of(path, name):
    return json.loads((path / INDEX).read_text())["weight_map"][name]


A_LOG, LM_HEAD, NORM = f"{P}4.self_attn.A_log", "language_model.lm_head.weight", "language_model.model.norm.weight"
OUT_NORM = "language_model.model.output_attn_res_norm.weight"


def unpad_a_log(path):  # the shape an [H] A_log (the old minidsa layout) has on disk
    return rewrite(path, A_LOG, lambda t, wm: t.update({A_LOG: t[A_LOG][:4].clone()}))


def old_mixer_name(path):
    def rename(t, wm):
        t["language_model.model.output_res_norm.weight"] = t.pop(OUT_NORM)
        wm["language_model.model.output_res_norm.weight"] = wm.pop(OUT_NORM)
    return rewrite(path, OUT_NORM, rename)


def truncate(path):
    fname = shard_of(path, NORM)
    with open(path / fname, "r+b") as f:
        f.truncate((path / fname).stat().st_size - 10)
    return fname


def corrupt_header(path):
    fname = shard_of(path, NORM)
    with open(path / fname, "r+b") as f:
        f.write(b"\xff" * 8)
    return fname


DAMAGES = [  # (id, damage(path) -> shard it concerns, expected (kind, name) findings, "(index)" for index-level)
    ("not-in-index", lambda p: rewrite(p, NORM, lambda t, wm: wm.pop(NORM)),
     [("missing", NORM), ("unexpected", NORM)]),
    ("not-in-shard", lambda p: rewrite(p, NORM, lambda t, wm: t.pop(NORM)), [("missing", NORM)]),
    ("extra", lambda p: rewrite(p, NORM, lambda t, wm: (t.update({f"{P}99.extra": torch.zeros(1)}),
                                                         wm.update({f"{P}99.extra": wm[NORM]}))),
     [("unexpected", f"{P}99.extra")]),
    ("unlisted", lambda p: rewrite(p, NORM, lambda t, wm: t.update({f"{P}99.extra": torch.zeros(1)})),
     [("unexpected", f"{P}99.extra")]),
    ("shape", unpad_a_log, [("shape", A_LOG)]),
    ("dtype", lambda p: rewrite(p, LM_HEAD, lambda t, wm: t.update({LM_HEAD: t[LM_HEAD].bfloat16()})),
     [("dtype", LM_HEAD)]),
    ("old-name", old_mixer_name, [("missing", OUT_NORM), ("unexpected", "language_model.model.output_res_norm.weight")]),
    ("no-file", lambda p: (p / shard_of(p, NORM)).unlink() or shard_of(p, NORM), [("shard", "")]),
    ("truncated", truncate, [("shard", "")]),
    ("bad-header", corrupt_header, [("shard", "")]),
]


@pytest.mark.parametrize("damage, expected", [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES])
def test_every_damage_is_found(saved, tmp_path, damage, expected):
    path = copy_of(saved, tmp_path)
    shard = damage(path)
    report = minidsa.check_checkpoint(path, progress=False)
    found = {(f.kind, f.name) for f in report.findings}
    assert set(expected) <= found, str(report)
    # each damage touches one tensor or one file: nothing else may be reported
    assert len(report.findings) == len(expected), str(report)
    assert {f.shard for f in report.findings} <= {shard, "(index)"}, str(report)


def test_damaged_a_log_tail_refused_at_load(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    rewrite(path, A_LOG, lambda t, wm: t[A_LOG].__setitem__(100, 1.0))  # a non-zero entry in the padding
    assert minidsa.check_checkpoint(path, progress=False).ok  # headers cannot show it ...
    with pytest.raises(ValueError, match=r"layers.4.self_attn.A_log has non-zero entries after its first 4"):
        minidsa.load(path)  # ... the loader, which reads the values, refuses it


def test_cli(saved, tmp_path, capsys):
    assert main(["check-checkpoint", str(saved), "--no-progress"]) == 0
    assert "OK: no findings" in capsys.readouterr().out
    path = copy_of(saved, tmp_path)
    unpad_a_log(path)
    assert main(["check-checkpoint", str(path), "--config", "tiny", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "shape" in out and A_LOG in out and "(4,) on disk, expected (128,)" in out
    assert main(["check-checkpoint", str(tmp_path / "nope"), "--no-progress"]) == 2
    assert main(["check-checkpoint", str(saved), "--config", "laptop", "--no-progress"]) == 1  # wrong config
    assert main(["check-checkpoint", str(saved), "--config", "default", "--no-progress"]) == 0  # the shipped: tiny


# ------------------------------------------------------------------- header-only reference-scale sets
def write_header_only(manifest, directory, num_shards):
    """Shards whose headers describe ``manifest`` and whose data sections are holes (sparse files: the
    data is never written); tensors go to shards in manifest order, about equal bytes per shard."""
    sizes = {n: math.prod(shape) * ITEM_BYTES[dtype] for n, (shape, dtype) in manifest.items()}
    total, done, members = sum(sizes.values()), 0, [[] for _ in range(num_shards)]
    for name, size in sizes.items():
        members[min(num_shards - 1, done * num_shards // total)].append(name)
        done += size
    weight_map = {}
    for i, names in enumerate(members, start=1):
        fname = f"model-{i:05d}-of-{num_shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in names:
            shape, dtype = manifest[name]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + sizes[name]]}
            offset += sizes[name]
            weight_map[name] = fname
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors pads its header to 8 bytes
        with open(directory / fname, "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            f.truncate(8 + len(blob) + offset)
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def reference_config(num_layers: int | None):
    cfg = minidsa.load_config("k3.1-pro")
    if num_layers is None:
        return cfg
    return cfg.replace(layer_types=cfg.layer_types[:num_layers - 1] + ["mla"])  # keeps a dense layer 0, MoE, MLA


@pytest.mark.parametrize("num_layers, num_shards", [
    (5, 16),  # 4 MoE layers, 21,810 tensors: seconds, for every run
    pytest.param(None, 96, marks=pytest.mark.skipif(not os.environ.get("MINIDSA_FULL_SCALE"),
                                                     reason="the full k3.1-pro set (~1 min): MINIDSA_FULL_SCALE=1")),
])
def test_reference_scale_header_set(tmp_path, num_layers, num_shards):
    cfg = reference_config(num_layers)
    cfg.to_json(tmp_path / "config.json")
    write_header_only(minidsa.checkpoint_manifest(cfg), tmp_path, num_shards)
    start = time.perf_counter()
    report = minidsa.check_checkpoint(tmp_path, progress=False)
    elapsed = time.perf_counter() - start
    assert report.ok and report.shards == num_shards, str(report)
    assert elapsed < 60, f"{elapsed:.1f} s"  # the full 96-shard set must check within a minute on a 2-core machine
    # one damaged header entry among them is found, by name: a transposed shape (same bytes, so nothing else)
    victim = f"{P}3.self_attn.indexer.weights_proj.weight"
    fname = json.loads((tmp_path / INDEX).read_text())["weight_map"][victim]
    header, data_bytes = read_header(tmp_path / fname)
    header[victim]["shape"] = header[victim]["shape"][::-1]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(tmp_path / fname, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + data_bytes)
    report = minidsa.check_checkpoint(tmp_path, progress=False)
    assert [(f.kind, f.shard, f.name) for f in report.findings] == [("shape", fname, victim)], str(report)
