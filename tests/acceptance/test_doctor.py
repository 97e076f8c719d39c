"""The Day-0 doctor (minidsa/acceptance/): it passes a sound model, and for each kind of damage it stops at
the rung that owns it, with a message that names what to look at."""

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import minidsa
from minidsa import ops
from minidsa.checkpoint.manifest import PRETRAINED
from minidsa.cli import main
from minidsa.formats import shards
from minidsa.serving import Engine, SamplingParams

RUNGS = ["checkpoint", "single operators", "single layers", "single request", "batched requests", "multimodal",
         "the service"]


@pytest.fixture(scope="module")
def shipped_report():
    t0 = time.perf_counter()
    report = minidsa.doctor("default")
    return report, time.perf_counter() - t0


@pytest.mark.slow  # the whole ladder, a server process included
def test_the_shipped_model_passes_every_rung_in_order(shipped_report):
    report, seconds = shipped_report
    assert report.ok, str(report)
    assert [g.name for g in report.gates] == RUNGS
    assert [g.status for g in report.gates] == ["PASS"] * 7
    assert "known answers" in report.gates[0].measured  # the shipped checkpoint records its evaluation
    assert not report.held_choices  # fp32: the choices are compared free
    assert seconds < 120, f"the doctor took {seconds:.0f} s on the shipped model"
    text = str(report)
    assert text.count("[PASS]") == 7 and "all 7 gates passed" in text
    assert "green triangle" in "".join(report.gates[5].details)  # the shipped model sees the drawn shape


@pytest.mark.slow  # the same report
def test_json_report_round_trips(shipped_report):
    data = json.loads(shipped_report[0].to_json())
    assert data["ok"] and len(data["gates"]) == 7
    assert all(g["status"] == "PASS" and g["seconds"] >= 0 for g in data["gates"])


def _copy_shipped(tmp_path: Path) -> Path:
    return Path(shutil.copytree(PRETRAINED["default"], tmp_path / "ckpt"))


def _rewrite(directory: Path, edit) -> None:
    """Apply ``edit`` to the tensors of the (single) shard and re-record its checksum, as a converter would."""
    index = json.loads((directory / shards.INDEX_NAME).read_text())
    shard = directory / next(iter(set(index["weight_map"].values())))
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["metadata"]["checksums"][shard.name] = shards.file_checksum(shard)
    (directory / shards.INDEX_NAME).write_text(json.dumps(index))


def _stops_at_checkpoint(report, *words):
    assert not report.ok and len(report.gates) == 1
    gate = report.failed
    assert gate.rung == 1 and gate.status == "FAIL" and gate.look_at
    text = str(report)
    assert "stopped at rung 1 (checkpoint)" in text
    for w in words:
        assert w in text, (w, text)


@pytest.mark.slow
def test_a_saved_preset_passes(tmp_path):
    directory = minidsa.build_model("tiny").save_pretrained(tmp_path / "tiny")
    report = minidsa.doctor(str(directory))
    assert report.ok, str(report)
    assert report.gates[0].status == "PASS" and "known answers" not in report.gates[0].measured


@pytest.mark.slow
def test_a_preset_name_skips_the_file_checks():
    report = minidsa.doctor("tiny")
    assert report.ok and report.gates[0].status == "SKIP" and len(report.gates) == 7


def test_a_damaged_shard_stops_at_the_checkpoint(tmp_path):
    directory = _copy_shipped(tmp_path)
    shard = next(directory.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: every header still reads right
    shard.write_bytes(bytes(data))
    _stops_at_checkpoint(minidsa.doctor(str(directory)), "checksum", shard.name)


def test_a_truncated_shard_is_found_from_its_header(tmp_path):
    directory = _copy_shipped(tmp_path)
    shard = next(directory.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _stops_at_checkpoint(minidsa.doctor(str(directory)), "the validator found", shard.name)


def test_a_swapped_tensor_fails_the_known_answers(tmp_path):
    """Two MLA layers' q_a_proj exchanged: same names, shapes, dtypes, a fresh checksum. Only behaviour shows it."""
    directory = _copy_shipped(tmp_path)
    a, b = (f"language_model.model.layers.{i}.self_attn.q_a_proj.weight" for i in (3, 7))

    def swap(t):
        t[a], t[b] = t[b].clone(), t[a].clone()
    _rewrite(directory, swap)
    assert minidsa.check_checkpoint(directory, progress=False).ok  # the headers cannot see it
    _stops_at_checkpoint(minidsa.doctor(str(directory)), "known answers", "exchanged")


def test_a_config_that_does_not_match_the_weights(tmp_path):
    directory = _copy_shipped(tmp_path)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["hidden_size"] += 8
    (directory / "config.json").write_text(json.dumps(cfg))
    _stops_at_checkpoint(minidsa.doctor(str(directory)), "shape", "config.json")


def test_a_broken_op_stops_at_the_operators(monkeypatch):
    """The model's decode attention loses its best selected key: the op rung names it before any layer runs."""
    original = ops.sparse_mla_decode_ref

    def broken(q_latent, q_pe, kv_plane, pe_plane, block_table, indices, scale):
        return original(q_latent, q_pe, kv_plane, pe_plane, block_table, indices[..., 1:], scale)
    monkeypatch.setattr(ops.OPS["sparse_mla_decode"], "reference", broken)  # what the public op calls
    report = minidsa.doctor("default")
    assert [g.status for g in report.gates] == ["PASS", "FAIL"]
    assert "sparse_mla_decode" in report.failed.look_at
    assert any(line.startswith("FAIL sparse_mla_decode") for line in report.failed.details)


def test_held_choices_replay_the_recorded_rows():
    """A cached run replaying a full forward's choices reproduces the full forward's logits (fp32)."""
    from minidsa.acceptance.held import HeldChoices
    model = minidsa.load("default")
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    held = HeldChoices()
    with torch.inference_mode():
        with held.recording():
            full = model(ids, trace=held.trace())
        cache = model.new_cache()
        sid = cache.add_sequence()
        with held.replaying():
            pre = model(ids[:, :20], cache=cache, seq_ids=[sid], trace=held.trace())
            rest = [model(ids[:, t:t + 1], cache=cache, seq_ids=[sid], trace=held.trace()) for t in range(20, 30)]
        held.key_of = lambda sid: "a sequence never recorded"
        with pytest.raises(RuntimeError, match="do not cover the same tokens"), held.replaying():
            model(ids[:, :1], trace=held.trace())
    cached = torch.cat([pre] + rest, dim=1)
    # fp32 in two orders of summation: a few 1e-6 of the logit scale; a replayed wrong row would cost O(1)
    assert ((cached - full).abs().max() / full.abs().max()).item() < 1e-5


def test_held_choices_are_taken_by_packed_engine_steps():
    """An engine built with held_choices records every step's choices per prompt and replays them in a batch
    whose sequences are numbered and packed differently; a replayed choice is what the layers then use."""
    from minidsa.acceptance.held import HeldChoices
    model = minidsa.load("default")
    held = HeldChoices()
    engine = Engine(model, max_num_seqs=4, enable_prefix_caching=False, held_choices=held)
    held.key_of = lambda sid: next(r.prompt for r in engine.requests.values() if r.sid == sid)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    texts = ["the pass key is 40271. the pass key is", "abc " * 9]
    with held.recording():
        alone = [engine.generate([t], params, progress=False)[0] for t in texts]
    modules = {key[0] for key in held.log}
    assert len(modules) == sum(1 for m in model.modules() if type(m).__name__ in ("LightningIndexer", "LatentMoE"))
    assert {key[1] for key in held.log} == set(texts)
    with held.replaying():
        batch = engine.generate(texts, params, progress=False)
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    assert all(held.cursor[key] == sum(len(r) for r in rows) for key, rows in held.log.items())  # every row replayed


@pytest.mark.slow  # a doctor run each, seconds on one core
def test_held_choices_through_the_engine_and_the_layers():
    """Every rung's held-choice path (what bf16 uses) on the fp32 model, which must pass it too."""
    report = minidsa.doctor("default", hold_choices=True)
    assert report.ok and report.held_choices and len(report.gates) == 7, str(report)
    assert "held fixed" in str(report)


@pytest.mark.slow
def test_cli_exit_codes_and_json(tmp_path, capsys):
    directory = _copy_shipped(tmp_path)
    (directory / "config.json").write_text(json.dumps({**json.loads((directory / "config.json").read_text()),
                                                       "hidden_size": 72}))
    assert main(["doctor", "--checkpoint", str(directory)]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] 1. checkpoint" in out and "stopped at rung 1" in out
    assert main(["doctor", "--checkpoint", "tiny", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["gates"][0]["status"] == "SKIP"
    assert main(["doctor", "--device", "tpu"]) == 2


@pytest.mark.slow  # three fresh server processes
def test_the_service_rung_serves_from_a_fresh_process():
    """The served text comes from `python -m minidsa serve` in its own process: given another checkpoint than the
    model in hand, the texts part and the rung fails; a checkpoint it cannot start names why."""
    from minidsa.acceptance import end_to_end
    shipped = minidsa.load("default", progress=False)
    ok, lines = end_to_end.check_service(shipped, "default", "torch", "cpu")
    assert ok and "fresh `python -m minidsa serve --checkpoint default" in lines[0]
    ok, lines = end_to_end.check_service(shipped, "tiny", "torch", "cpu")  # random weights serve other text
    assert not ok
    ok, lines = end_to_end.check_service(shipped, "no-such-checkpoint", "torch", "cpu")
    assert not ok and "did not start serving" in lines[0]


def test_the_fp32_twin_holds_the_model_weights_widened():
    """The service rung checks graphs against eager steps on an fp32 twin: every tensor of the bf16 model's
    state is in the twin, widened exactly (bf16 -> fp32 loses nothing; MXFP4 codes and scales copied); an
    fp32 model is its own twin."""
    from minidsa.acceptance.end_to_end import fp32_twin
    model = minidsa.MiniDSA(minidsa.load_config("tiny").replace(dtype="bfloat16"))
    twin = fp32_twin(model)
    assert twin.config.torch_dtype == torch.float32 and twin is not model
    mine, theirs = model.state_dict(), twin.state_dict()
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():
        assert torch.equal(t.to(theirs[name].dtype), theirs[name]), name
    assert fp32_twin(twin) is twin


def test_the_engine_rung_fails_a_replay_that_differs_from_the_eager_step(monkeypatch):
    from minidsa.acceptance import end_to_end
    from minidsa.serving.cuda_graphs import DecodeGraphs
    model = minidsa.load("default", progress=False)
    ok, lines = end_to_end.check_graphs(model, 1e-4)
    assert ok and "decode steps as eager padded steps" in lines[0]
    replay = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, sids, toks: replay(self, sids, toks) * 1.01)  # stale memory
    ok, lines = end_to_end.check_graphs(model, 1e-4)
    assert not ok and ("worst logits 1.0e-02" in lines[0] or "worst logits 9.9" in lines[0])


@pytest.mark.parametrize("hold", [False, True])
def test_the_batch_gate_fails_when_its_requests_fail(monkeypatch, hold):
    """Requests that end in error have no tokens to compare: the gate must say so, not find them equal."""
    from minidsa.acceptance import end_to_end
    from minidsa.serving.runner import ModelRunner

    def broken(*args, **kwargs):
        raise RuntimeError("a broken step")
    monkeypatch.setattr(ModelRunner, "execute", broken)
    ok, lines = end_to_end.check_batch(minidsa.load("default"), 1e-3, hold)
    assert not ok and "'error'" in lines[0] and "a broken step" in lines[0]
