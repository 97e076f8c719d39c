"""Resuming a run whose directory holds files of two runs (a checkpoint replaced by another model's, another
run's training state copied in) is one `error:` line naming what differs, exit status 2, and nothing
written; a directory of one run resumes as before (docs/design.md §2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_config
from safetensors import safe_open
from safetensors.torch import save_file

import minidsa
from minidsa.cli import main
from minidsa.training.loop import LOG_FILE, TrainConfig, train
from minidsa.training.state import STATE_FILE, load_state

ROOT = Path(__file__).resolve().parents[2]
# One quick leg of a two-step run on tiny: pass-key rows only, short context, one evaluation sample.
LEG = ["--dense-steps", "1", "--warmup-steps", "0", "--sparse-steps", "1", "--batch-size", "1",
       "--mm-batch-size", "0", "--context", "80", "--eval-n", "1", "--no-progress"]


def cli(*argv) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "minidsa", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
    return lines[0]


@pytest.mark.slow  # trains a leg in a CLI process
def test_resume_over_another_models_checkpoint_is_one_error_line_and_exit_2(tmp_path):
    run = tmp_path / "run"
    first = cli("train", "--out", str(run), *LEG, "--leg-steps", "1")
    assert first.returncode == 0, first.stderr[-2000:]
    minidsa.MiniDSA(tiny_config(dense_intermediate_size=96)).save_pretrained(run)  # over the run's checkpoint
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    log = json.loads((run / LOG_FILE).read_text())  # the run's log records the model it trains, too

    resumed = cli("train", "--out", str(run), "--resume", "--no-progress")
    assert resumed.returncode == 2, resumed.stderr[-2000:]
    err = one_error_line(resumed.stderr)
    assert "Traceback" not in resumed.stderr
    assert "dense_intermediate_size 96 (checkpoint) vs 128 (state)" in err, err
    assert "another out_dir (--out)" in err and "--overwrite" in err, err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # refused before any step or save
    assert log["model_config"] == tiny_config().to_dict()


def test_resume_with_another_runs_state_names_the_fields_or_tensors(tmp_path, capsys):
    def leg(out, **kw) -> dict:
        return train(TrainConfig(out_dir=str(out), dense_steps=1, warmup_steps=0, sparse_steps=1, batch_size=1,
                                 mm_batch_size=0, context=80, eval_n=1, progress=False, **kw))

    run, other = tmp_path / "run", tmp_path / "other"
    leg(run, leg_steps=1)
    tiny_config(dense_intermediate_size=96, name="other").to_json(tmp_path / "other.json")
    leg(other, model=str(tmp_path / "other.json"), leg_steps=1)
    shutil.copy(other / STATE_FILE, run / STATE_FILE)  # another run's state beside this run's checkpoint

    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "dense_intermediate_size 128 (checkpoint) vs 96 (state)" in err, err
    assert "name 'tiny'" not in err  # a label, not a difference between the models

    # A state written before the model's config was recorded: the tensors tell the models apart
    state = run / STATE_FILE
    with safe_open(str(state), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    log = json.loads(meta["log"])
    del log["model_config"]
    save_file(tensors, str(state), metadata={**meta, "log": json.dumps(log)})
    assert load_state(run)["model_config"] is None
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "layers.0.mlp.gate_proj.weight [128, 64] float32 (checkpoint) vs [96, 64] float32 (state)" in err, err
    assert "9 tensor(s) differ" in err  # the dense MLP's 3 weights and AdamW's 2 moments of each

    # a checkpoint whose config differs from the state's only in serving capacity is still the run's
    fresh = tmp_path / "fresh"
    leg(fresh, leg_steps=1)
    set_config(fresh, max_sequences=4, kv_num_blocks=32)
    assert main(["train", "--out", str(fresh), "--resume", "--no-progress"]) == 0
    assert load_state(fresh)["step"] == 2


def set_config(checkpoint: Path, **changes) -> None:
    """Change fields of a saved checkpoint's config, in config.json and in the copy its index embeds."""
    (checkpoint / "config.json").write_text(json.dumps({**json.loads((checkpoint / "config.json").read_text()),
                                                        **changes}))
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    index["metadata"]["config"] = json.dumps({**json.loads(index["metadata"]["config"]), **changes})
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
