"""The training path: the lean forward equals the reference, the recipe's stages train what they should,
resuming is exact, the synthetic data is seeded, and `eval` prints every metric (docs/design.md §2)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import minidsa
from minidsa.cli import main
from minidsa.formats import mxfp4
from minidsa.ops import kda_chunk_ref
from minidsa.training import tasks
from minidsa.training.evaluation import digits_correct, rows_correct
from minidsa.training.forward import TrainingModel
from minidsa.training.lean_ops import kda_chunk_train, selection_mask, train_chunk_size
from minidsa.training.loop import LOG_FILE, RECIPES, TrainConfig, answer_loss, easy_keys, step_losses, text_loss, train
from minidsa.training.state import LEGACY_STATE_FILE, STATE_FILE, load_state

TINY64 = minidsa.load_config("tiny").replace(dtype="float64")


def fast(tmp_path, **kw) -> TrainConfig:
    """A few-second run on tiny: short context, small batches, no periodic evaluation."""
    base = dict(model="tiny", out_dir=str(tmp_path / "run"), dense_steps=2, warmup_steps=1, sparse_steps=2,
                batch_size=2, mm_batch_size=1, context=80, lr_warmup=1, eval_every=0, eval_n=2, progress=False)
    return TrainConfig(**{**base, **kw})


def retrieval_batch(cfg, n=2, context=80):
    return tasks.encode(tasks.samples("retrieval", "train", 0, 0, n, context), cfg)


# ------------------------------------------------------------------------------- lean path = reference
def test_lean_forward_equals_reference_logits_loss_and_gradients():
    # fp64, so the indexer scores are exact and no top-k tie can flip between the two paths; 1e-9 is
    # float64 rounding through 9 layers, far below any real difference (a wrong mask or decay is > 1e-3).
    model = minidsa.MiniDSA(TINY64)
    tm = TrainingModel(model)
    batch = retrieval_batch(TINY64, context=100)  # 100: the KDA tail chunk is partial
    ref = answer_loss(model(batch.input_ids), batch.labels)
    logits, _ = tm(batch.input_ids)
    lean = answer_loss(logits, batch.labels)
    assert torch.allclose(logits, model(batch.input_ids), atol=1e-9, rtol=0)
    assert abs(float(ref.detach() - lean.detach())) < 1e-9
    params = [p for p in model.parameters() if p.requires_grad]
    g_ref = torch.autograd.grad(ref, params, allow_unused=True)
    g_lean = torch.autograd.grad(lean, params, allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), g_ref, g_lean):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.allclose(a, b, atol=1e-9, rtol=1e-7), name


def test_lean_loss_equals_reference_in_fp32():
    # fp32: the same function summed in a different order; 1e-5 relative is ~100 ulps of a loss near 5.6.
    model = minidsa.MiniDSA("tiny")
    batch = retrieval_batch(model.config, context=128)
    with torch.no_grad():
        ref = answer_loss(model(batch.input_ids), batch.labels)
        lean = answer_loss(TrainingModel(model)(batch.input_ids)[0], batch.labels)
    assert abs(float(ref - lean)) <= 1e-5 * float(ref)


def test_kda_chunk_train_equals_reference_at_the_strongest_decay():
    torch.manual_seed(0)
    B, T, H, K = 2, 77, 2, 8
    q, v = torch.randn(B, T, H, K, dtype=torch.float64), torch.randn(B, T, H, K, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    g = -5.0 + 0.01 * torch.rand(B, T, H, K, dtype=torch.float64)  # at the lower bound: the largest factors
    beta = torch.rand(B, T, H, dtype=torch.float64)
    C = train_chunk_size(-5.0, 64)
    assert C == 32  # |lb| * C / 2 = 80 <= 80, and 64 would give e^160
    ref = kda_chunk_ref(q, k, v, g, beta, chunk_size=64)[0]
    assert torch.allclose(kda_chunk_train(q, k, v, g, beta, C), ref, atol=1e-10)
    out32 = kda_chunk_train(q.float(), k.float(), v.float(), g.float(), beta.float(), C)
    assert torch.isfinite(out32).all() and torch.allclose(out32.double(), ref, atol=1e-4)


def test_random_selection_keeps_topk_causal_keys():
    gen = torch.Generator().manual_seed(0)
    mask = selection_mask(None, 8, 40, "cpu", "random", gen, batch=3)
    t = torch.arange(40)
    assert torch.equal(mask.sum(-1), torch.minimum(t + 1, torch.tensor(8)).expand(3, 40))
    assert not (mask & ~torch.ones(40, 40, dtype=torch.bool).tril()).any()


# ---------------------------------------------------------------------------------------- the recipe
def test_a_few_steps_lower_the_loss(tmp_path):
    # The first steps learn that answers are digits then eos: a drop of > 1 nat from ln(264) = 5.6
    # is far outside step-to-step noise (about 0.05 here).
    # The plain task (no repeated-digit keys, answer loss alone), so the logged loss is the objective.
    result = train(fast(tmp_path, dense_steps=8, warmup_steps=0, sparse_steps=0, lr=1e-2, easy_key_steps=0,
                        text_loss_weight=0.0))
    lm = [h["lm"] for h in result["history"]]
    assert lm[0] > 5.0 and sum(lm[-2:]) / 2 < lm[0] - 1.0, lm


def test_warmup_updates_only_the_indexers(tmp_path):
    fresh = TrainingModel(minidsa.MiniDSA("tiny")).state_dict()
    train(fast(tmp_path, dense_steps=0, warmup_steps=2, sparse_steps=0))
    state = load_state(tmp_path / "run")["model"]
    changed = {n for n in fresh if fresh[n].is_floating_point() and not torch.equal(fresh[n], state[n])}
    indexer = {n for n in fresh if ".indexer." in n and fresh[n].is_floating_point()}
    assert changed and changed <= indexer, sorted(changed - indexer)
    assert indexer <= changed  # every indexer tensor moved


def test_indexer_losses_see_the_multimodal_rows_and_focus_only_the_sparse_stage(tmp_path):
    # The indexer must learn where an answer about an image looks, so the multimodal rows' MLA inputs enter
    # its KL; the focus term exists only in the sparse stage, and only when weighted.
    tm = TrainingModel(minidsa.MiniDSA("tiny"))
    cfg = fast(tmp_path, dense_steps=0, warmup_steps=1, sparse_steps=1, focus_loss_weight=0.5)
    with_mm = step_losses(tm, cfg, 0)
    without = step_losses(tm, dataclasses.replace(cfg, mm_batch_size=0), 0)
    assert "mm" in with_mm and "mm" not in without and abs(with_mm["kl"].item() - without["kl"].item()) > 1e-6
    assert "focus" not in with_mm  # warm-up
    sparse = step_losses(tm, cfg, 1)
    assert sparse["focus"].requires_grad and sparse["focus"].item() > 0
    assert "focus" not in step_losses(tm, dataclasses.replace(cfg, focus_loss_weight=0.0), 1)


@pytest.mark.slow  # two legs of training
def test_resume_equals_uninterrupted_training(tmp_path):
    # Bitwise: the data is a function of (seed, step), the schedule of the step, and the training state
    # holds the float master weights and AdamW's moments; a CPU run is deterministic.
    whole = train(fast(tmp_path, out_dir=str(tmp_path / "a")))
    first = train(fast(tmp_path, out_dir=str(tmp_path / "b"), leg_steps=3))
    assert first["step"] == 3 and not first["done"]
    second = train(fast(tmp_path, out_dir=str(tmp_path / "b"), context=999), resume=True)  # run fields: kept
    assert second["done"] and [h["lm"] for h in second["history"]] == [h["lm"] for h in whole["history"]]
    a = load_state(tmp_path / "a")["model"]
    b = load_state(tmp_path / "b")["model"]
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_checkpoint_holds_the_quantised_masters_and_loads(tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    matplotlib.use("svg")   # stands in for a notebook's inline backend: saving the curves must not switch it
    try:
        train(fast(tmp_path, dense_steps=1, warmup_steps=0, sparse_steps=1))
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(backend)
    state = load_state(tmp_path / "run")["model"]
    model = minidsa.load(tmp_path / "run", progress=False)
    layer = model.moe_layers()[0]
    packed, scales = mxfp4.quantize(state["experts.0.w1"])
    codes, e8m0 = layer.experts.matrix("w1")
    assert torch.equal(codes, packed) and torch.equal(e8m0, scales)
    assert not torch.equal(state["experts.0.w1"], mxfp4.dequantize(packed, scales))  # trained off the grid
    assert (tmp_path / "run" / "loss_curves.png").stat().st_size > 1000
    log = json.loads((tmp_path / "run" / LOG_FILE).read_text())   # the history again, readable without torch
    assert [h["step"] for h in log["history"]] == [0, 1] and [h["stage"] for h in log["history"]] == ["dense", "sparse"]
    assert log["train_config"]["dense_steps"] == 1 and log["evals"][-1]["step"] == 2


def test_recipes_are_named_config_overrides():
    quick = TrainConfig.from_recipe("quick", out_dir="x")
    assert TrainConfig.from_recipe("shipped") == TrainConfig()
    assert quick.out_dir == "x" and quick.mm_batch_size == 0 and quick.total_steps < TrainConfig().total_steps / 5
    assert dataclasses.replace(quick, **RECIPES["quick"], out_dir=TrainConfig().out_dir) == \
        dataclasses.replace(TrainConfig(), **RECIPES["quick"])
    with pytest.raises(ValueError, match="'fast'.*quick"):
        TrainConfig.from_recipe("fast")


def test_bad_train_config_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        train(fast(tmp_path, batch_size=0))
    with pytest.raises(ValueError, match="resume"):
        train(fast(tmp_path, out_dir=str(tmp_path / "none")), resume=True)


# -------------------------------------------------------------------------------------------- data
def test_easy_key_curriculum_rewrites_key_and_answer_together():
    cfg = TrainConfig(easy_key_steps=3, easy_key_frac=0.0, seed=1)
    rows = tasks.samples("retrieval", "train", 0, 0, 6, 80)
    early, late = easy_keys(rows, cfg, step=2), easy_keys(rows, cfg, step=3)
    for s, e in zip(rows, early):
        assert len(set(e.answer)) == 1 and len(e.answer) == tasks.KEY_DIGITS  # one digit repeated
        assert e.prompt == s.prompt.replace(f" is {s.answer}.", f" is {e.answer}.", 1)
        assert len(e.prompt) == len(s.prompt) and e.passage_start == s.passage_start
    assert late == rows  # easy_key_frac 0: after the curriculum the rows are untouched
    assert easy_keys(rows, cfg, step=2) == early  # seeded by (seed, step)


def test_text_loss_is_next_token_cross_entropy_over_non_pad_tokens():
    pad = 7
    ids = torch.tensor([[1, 2, 3, pad], [4, 5, pad, pad]])
    logits = torch.randn(2, 4, 10, generator=torch.Generator().manual_seed(0))
    pairs = [(0, 0, 2), (0, 1, 3), (1, 0, 5)]  # (row, position, next token); pad targets are skipped
    want = torch.stack([-torch.log_softmax(logits[b, t], -1)[y] for b, t, y in pairs]).mean()
    assert torch.allclose(text_loss(logits, ids, pad), want, atol=1e-6)


def test_data_is_seeded_and_held_out_seeds_differ():
    a = tasks.samples("retrieval", "train", 3, 10, 4, 128)
    assert [s.prompt for s in a] == [s.prompt for s in tasks.samples("retrieval", "train", 3, 10, 4, 128)]
    held_out = tasks.samples("retrieval", "eval", 3, 10, 4, 128)
    assert all(x.prompt != y.prompt and x.answer != y.answer for x, y in zip(a, held_out))
    assert a[0].prompt != tasks.samples("retrieval", "train", 4, 10, 1, 128)[0].prompt
    m1, m2 = tasks.samples("multimodal", "train", 0, 0, 2), tasks.samples("multimodal", "eval", 0, 0, 2)
    assert (m1[0].image == tasks.samples("multimodal", "train", 0, 0, 1)[0].image).all()
    assert not (m1[0].image == m2[0].image).all()


def test_retrieval_rows_fill_the_context_and_answer_from_an_early_passage():
    cfg = minidsa.load_config("tiny")
    samples = tasks.samples("retrieval", "eval", 0, 0, 8, 128, num_distractors=2)
    batch = tasks.encode(samples, cfg)
    assert batch.input_ids.shape == (8, 128) and bool((batch.labels != -100).sum(1).eq(tasks.KEY_DIGITS + 1).all())
    for s in samples:
        passage = f"The pass key of {s.prompt.split('pass key of ')[-1][:3]} is {s.answer}."
        assert s.prompt.count(passage) == 1 and s.prompt.index(passage) <= 128 // 4 + 1
        assert s.prompt.count("The pass key of") == 3
    with pytest.raises(ValueError, match="context"):
        tasks.samples("retrieval", "train", 0, 0, 1, 40)
    with pytest.raises(ValueError, match="seed"):
        tasks.samples("retrieval", "train", -1, 0, 1, 128)


def test_multimodal_answer_names_what_is_drawn():
    s = tasks.samples("multimodal", "train", 0, 0, 6)
    for x in s:
        colour, shape = x.answer.split()
        assert colour in tasks.COLOURS and shape in tasks.SHAPES and x.image.shape == (56, 56, 3)
    batch = tasks.encode(s, minidsa.load_config("tiny"))
    assert len(batch.images) == 6 and (batch.input_ids == minidsa.ByteTokenizer().media_pad_id).sum(1).eq(4).all()


def test_digit_accuracy_counts_key_digits_not_eos():
    eos = 7
    labels = torch.tensor([[-100, 3, 4, eos, -100], [-100, -100, 5, 6, eos]])
    logits = torch.zeros(2, 5, 10)
    for b, t, v in ((0, 1, 3), (0, 2, 9), (0, 3, eos), (1, 2, 5), (1, 3, 6), (1, 4, 0)):
        logits[b, t, v] = 1.0
    assert digits_correct(logits, labels, eos) == (3, 4)   # 3 of the 4 digits; the eos hits and misses ignored
    assert rows_correct(logits, labels).tolist() == [False, False]


# -------------------------------------------------------------------------------------------- CLI
def test_eval_prints_every_metric(capsys):
    assert main(["eval", "--checkpoint", "tiny", "--n", "2", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    names = [line.split(": ")[0] for line in lines]
    cfg = minidsa.load_config("tiny")
    assert names == ["retrieval_accuracy", "retrieval_digit_accuracy", "retrieval_accuracy_random_selection",
                     *[f"indexer_recall_layer{i}" for i in cfg.mla_layers], "multimodal_accuracy",
                     "retrieval_accuracy_dense", "multimodal_accuracy_dense", "context_length", "topk"]
    values = dict(line.split(": ") for line in lines)
    assert values["context_length"] == "128" and values["topk"] == "8"
    assert all(0 <= float(values[f"indexer_recall_layer{i}"]) <= 1 for i in cfg.mla_layers)


def test_train_cli_writes_a_checkpoint_eval_reads(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["train", "--out", str(out), "--dense-steps", "1", "--warmup-steps", "0", "--sparse-steps", "1",
                 "--batch-size", "1", "--mm-batch-size", "1", "--context", "80", "--eval-n", "1",
                 "--no-progress"]) == 0
    assert "finished at step 2" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(out), "--n", "1", "--context", "80"]) == 0
    assert "context_length: 80" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(out), "--seed", "-1"]) == 2
    # --recipe sets the defaults and explicit options win: the quick recipe's loss weights, two steps
    quick = tmp_path / "quick"
    assert main(["train", "--recipe", "quick", "--out", str(quick), "--dense-steps", "1", "--warmup-steps", "0",
                 "--sparse-steps", "1", "--batch-size", "1", "--eval-n", "1", "--no-progress"]) == 0
    run = json.loads((quick / LOG_FILE).read_text())["train_config"]
    assert run["text_loss_weight"] == RECIPES["quick"]["text_loss_weight"] and run["mm_batch_size"] == 0
    assert run["dense_steps"] == 1 and run["batch_size"] == 1


def test_shipped_checkpoint_answers_a_held_out_retrieval_prompt():
    """minidsa.load("default") is the trained model: greedy decoding through the cached (paged, sparse)
    path returns the pass key of a held-out prompt, and the shipped files stay under 32 MB."""
    from minidsa.checkpoint.manifest import PRETRAINED
    assert sum(f.stat().st_size for f in PRETRAINED["default"].iterdir()) < 32 * 2**20
    model = minidsa.load("default", progress=False)
    sample = tasks.samples("retrieval", "eval", 123, 0, 1, 72)[0]
    assert minidsa.generate(sample.prompt, model, temperature=0, max_new_tokens=8) == sample.answer


def test_shipped_checkpoint_names_colour_and_shape_of_held_out_images():
    """The shipped model's multimodal accuracy is 0.99 on 256 held-out images (README): eight more held-out
    images through generate() (vision tower, prefill, cached sparse decode) must all be named right."""
    model = minidsa.load("default", progress=False)
    for s in tasks.samples("multimodal", "eval", 123, 0, 8):
        assert minidsa.generate(s.prompt, model, images=[s.image], temperature=0, max_new_tokens=16) == s.answer


# ------------------------------------------------------------------------------------ the state on disk
def test_training_state_is_safetensors_and_a_pickle_is_refused(tmp_path):
    import os
    import pickle

    run = tmp_path / "run"
    train(fast(tmp_path, dense_steps=1, warmup_steps=0, sparse_steps=1))
    with open(run / STATE_FILE, "rb") as f:   # safetensors: an 8-byte header length, then a JSON header
        assert f.read(9)[8:] == b"{"
    state = load_state(run)
    assert state["step"] == 2 and len(state["history"]) == 2 and state["optimizer"]["state"]

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    with open(legacy / LEGACY_STATE_FILE, "wb") as f:
        pickle.dump({"step": 1, "model": Evil()}, f)
    with pytest.raises(ValueError, match="cannot be read safely"):
        load_state(legacy)
    assert not (tmp_path / "owned").exists()


@pytest.mark.slow
def test_a_state_write_cut_short_keeps_the_previous_leg(tmp_path, monkeypatch):
    from minidsa.training import state as state_mod

    run = tmp_path / "run"
    train(fast(tmp_path, dense_steps=2, warmup_steps=0, sparse_steps=2, leg_steps=2))
    before = load_state(run)

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)   # half a file, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state_mod, "save_file", disk_full)
    with pytest.raises(OSError):
        train(fast(tmp_path, dense_steps=2, warmup_steps=0, sparse_steps=2, leg_steps=2), resume=True)
    monkeypatch.undo()
    after = load_state(run)
    assert after["step"] == before["step"] == 2
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])
    result = train(fast(tmp_path, dense_steps=2, warmup_steps=0, sparse_steps=2), resume=True)
    assert result["done"] and result["step"] == 4


def test_resume_from_a_damaged_state_is_one_clear_error(tmp_path, capsys):
    run = tmp_path / "run"
    train(fast(tmp_path, dense_steps=1, warmup_steps=0, sparse_steps=1, leg_steps=1))
    data = (run / STATE_FILE).read_bytes()
    (run / STATE_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="damaged or incomplete"):
        load_state(run)
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and STATE_FILE in err[0]


# ------------------------------------------------------------------------------------------ run directories
def test_an_unwritable_run_directory_fails_before_any_step(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    steps = []
    monkeypatch.setattr("minidsa.training.loop.train_step", lambda *a: steps.append(1))
    with pytest.raises(OSError, match="cannot write the run directory"):
        train(fast(tmp_path, out_dir=str(blocker / "run")))
    assert not steps


@pytest.mark.slow
def test_an_existing_run_is_not_overwritten_without_asking(tmp_path, capsys):
    train(fast(tmp_path, dense_steps=1, warmup_steps=0, sparse_steps=1))
    before = load_state(tmp_path / "run")
    with pytest.raises(ValueError, match="already holds a training run.*--resume.*--overwrite"):
        train(fast(tmp_path, dense_steps=1, warmup_steps=0, sparse_steps=1, seed=3))
    assert load_state(tmp_path / "run")["history"] == before["history"]
    assert main(["train", "--out", str(tmp_path / "run"), "--dense-steps", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert train(fast(tmp_path, dense_steps=1, warmup_steps=0, sparse_steps=1, seed=3), overwrite=True)["done"]


def test_resume_keeps_the_runs_own_options_and_refuses_to_change_fixed_ones(tmp_path, capsys):
    out = str(tmp_path / "cli")
    base = ["--dense-steps", "2", "--warmup-steps", "0", "--sparse-steps", "1", "--batch-size", "1",
            "--mm-batch-size", "0", "--context", "80", "--no-progress"]
    assert main(["train", "--out", out, *base, "--eval-n", "3", "--leg-steps", "1", "--lr", "0.002"]) == 0
    capsys.readouterr()
    for bad in (["--config", "laptop"], ["--lr", "0.01"]):
        assert main(["train", "--out", out, "--resume", *bad, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot change when resuming" in err[0]
    assert main(["train", "--out", out, "--resume", "--leg-steps", "1", "--no-progress"]) == 0
    assert main(["train", "--out", out, "--resume", "--no-progress"]) == 0
    saved = load_state(tmp_path / "cli")
    assert saved["step"] == 3 and saved["train_config"]["eval_n"] == 3 and saved["train_config"]["lr"] == 0.002
