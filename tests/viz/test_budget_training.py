"""minidsa.viz memory budget and training curves: the budget against the cache layout and the expert format
arithmetic, the curves against what a run records (its training_state.pt, read without unpickling), and
each picture rendered to PNG with the bars, labels, legend and title it must show."""


import dataclasses
import json

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from figures import legend_texts, render  # noqa: E402

import minidsa  # noqa: E402
from minidsa.checkpoint.manifest import pretrained_dir  # noqa: E402
from minidsa.training.loop import LEG_FIELDS, LOG_FILE, TrainConfig  # noqa: E402
from minidsa.training.state import LEGACY_STATE_FILE, STATE_FILE  # noqa: E402
from minidsa.viz import budget as vbudget  # noqa: E402
from minidsa.viz import training as vtrain  # noqa: E402
from minidsa.viz._common import meta_model  # noqa: E402


# --------------------------------------------------------------------------------------------- budget
def test_memory_budget_follows_the_layout_and_the_formats():
    context = 1_000_000
    b = vbudget.memory_budget("k3.1-pro", context)
    model = meta_model("k3.1-pro")
    layout = model.cache_layout()
    assert b["kv_cache"] + b["indexer_keys"] == context * layout.bytes_per_token()
    assert b["kda_state"] == layout.state_bytes_per_sequence()
    assert b["per_sequence"] == b["kv_cache"] + b["indexer_keys"] + b["kda_state"]
    cfg = minidsa.load_config("k3.1-pro")
    m = cfg.moe
    elements = (cfg.num_layers - m.first_dense_layers) * m.num_experts * 3 * m.latent_size * m.expert_intermediate_size
    assert b["routed_experts_mxfp4"] == 0.5 * elements + elements / 32
    assert b["routed_experts_fp8"] == elements + elements / 32 and b["routed_experts_bf16"] == 2 * elements
    for f in ("mxfp4", "fp8", "bf16"):
        assert b[f"weights_{f}_experts"] == b["other_weights"] + b[f"routed_experts_{f}"]
    other_params = sum(p.numel() for p in model.parameters())  # every non-expert weight: bf16, some fp32
    assert 2 * other_params < b["other_weights"] < 4 * other_params
    assert b["fp8_workspace"] == m.workspace_experts * 3 * m.latent_size * m.expert_intermediate_size * (1 + 1 / 32)
    assert b["total"] == b["weights_mxfp4_experts"] + b["fp8_workspace"] + b["per_sequence"]
    empty = vbudget.memory_budget("k3.1-pro", 0)
    assert empty["kv_cache"] == empty["indexer_keys"] == 0 and empty["kda_state"] == b["kda_state"]


def test_memory_budget_of_the_shipped_model_uses_its_cache():
    model = minidsa.load("default")
    b = vbudget.memory_budget("default", 256)
    assert b["kv_cache"] + b["indexer_keys"] == 256 * model.cache_layout().bytes_per_token()
    assert b["kda_state"] == model.cache_layout().state_bytes_per_sequence()
    assert b["routed_experts_mxfp4"] == model.expert_stats()["expert_bytes_mxfp4"]
    with pytest.raises(ValueError, match="context"):
        vbudget.memory_budget("default", -1)


def test_plot_memory_budget_labels_every_bar_in_gb():
    fig = vbudget.plot_memory_budget("k3.1-pro", 1_000_000)
    ax = fig.axes[0]
    b = vbudget.memory_budget("k3.1-pro", 1_000_000)
    widths = sorted(p.get_width() for p in ax.patches)
    assert len(widths) == 9
    expected = [b[k] for k in ("weights_mxfp4_experts", "weights_fp8_experts", "weights_bf16_experts", "kv_cache",
                               "indexer_keys", "kda_state", "per_sequence", "fp8_workspace", "total")]
    assert widths == sorted(expected)
    labels = [t.get_text().strip() for t in ax.texts]
    assert len(labels) == 9 and all(t.endswith(" GB") for t in labels)
    assert f"{b['kv_cache'] / 1e9:.1f} GB" in labels
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert any("1M tokens" in t for t in ticks) and any("KDA" in t for t in ticks)
    assert legend_texts(ax) == ["weights", "per-sequence cache at 1M tokens", "run-time workspace", "total"]
    assert "k3.1-pro" in ax.get_title() and "1M" in ax.get_title() and ax.get_xscale() == "log"
    render(fig)


# ------------------------------------------------------------------------------------------- training
def fake_history(dense=6, warmup=2, sparse=4):
    cfg = TrainConfig(dense_steps=dense, warmup_steps=warmup, sparse_steps=sparse, easy_key_steps=3)
    rows = []
    for step in range(cfg.total_steps):
        stage = "dense" if step < dense else "warmup" if step < dense + warmup else "sparse"
        row = {"step": step, "stage": stage, "lr": 1e-3, "lm": 5.0 / (1 + step), "text": 4.0 / (1 + step)}
        if stage != "dense":
            row["kl"] = 0.5 / (step - dense + 1)
        rows.append(row)
    evals = [{"step": cfg.total_steps, "retrieval_accuracy": 0.5, "multimodal_accuracy": 0.25,
              "retrieval_accuracy_dense": 0.75}]
    return rows, evals, cfg


@pytest.fixture
def run_dir(tmp_path):
    """A run directory as ``minidsa.train`` leaves it (training_state.pt of plain tensors, lists and dicts)."""
    rows, evals, cfg = fake_history()
    torch.save({"step": cfg.total_steps, "model": {"w": torch.zeros(2)}, "optimizer": {"state": {}, "param_groups": []},
                "history": rows, "evals": evals, "train_config": cfg.__dict__.copy()}, tmp_path / LEGACY_STATE_FILE)
    return tmp_path


def test_load_history_reads_every_form(run_dir):
    rows, evals, cfg = fake_history()
    got, got_evals, got_cfg = vtrain.load_history(run_dir)
    assert got == rows and got_evals == evals and got_cfg["easy_key_steps"] == 3
    assert vtrain.load_history(run_dir / LEGACY_STATE_FILE)[0] == rows
    assert vtrain.load_history({"history": rows, "evals": evals})[:2] == (rows, evals)
    as_lists = {"lm": [r["lm"] for r in rows], "stage": [r["stage"] for r in rows]}
    assert [r["step"] for r in vtrain.load_history(as_lists)[0]] == list(range(len(rows)))
    assert vtrain.stage_spans(rows, {}) == [("dense", 0, 6), ("warmup", 6, 8), ("sparse", 8, 12)]
    assert vtrain.stage_spans([{"step": s} for s in range(12)], cfg.__dict__) == vtrain.stage_spans(rows, {})
    with pytest.raises(ValueError, match=STATE_FILE):
        vtrain.load_history(run_dir / "missing")


def test_load_history_prefers_the_json_log(run_dir):
    rows, evals, cfg = fake_history()
    (run_dir / LOG_FILE).write_text(json.dumps({"history": rows[:5], "evals": [], "train_config": {}}))
    assert vtrain.load_history(run_dir)[0] == rows[:5]   # the JSON log, not the state beside it
    assert vtrain.load_history(run_dir / LOG_FILE)[0] == rows[:5]


def test_a_run_without_image_rows_draws_no_multimodal_accuracy():
    rows, evals, cfg = fake_history()
    run = {"history": rows, "evals": evals, "train_config": {**cfg.__dict__, "mm_batch_size": 0}}
    texts = legend_texts(vtrain.plot_training_curves(run).axes[0])
    assert "retrieval accuracy, top-k (held-out)" in texts and not any("multimodal" in t for t in texts)
    assert "easy-key curriculum ends (step 3)" in texts   # from the run's own config
    with_images = legend_texts(vtrain.plot_training_curves({**run, "train_config": cfg.__dict__}).axes[0])
    assert "multimodal accuracy, top-k (held-out)" in with_images


def test_the_shipped_model_ships_its_recipe_log():
    rows, evals, cfg = vtrain.load_history(pretrained_dir("default"))
    assert len(rows) == TrainConfig().total_steps == cfg["dense_steps"] + cfg["warmup_steps"] + cfg["sparse_steps"]
    assert {k: v for k, v in cfg.items() if k not in LEG_FIELDS} == \
        {k: v for k, v in dataclasses.asdict(TrainConfig()).items() if k not in LEG_FIELDS}   # the shipped recipe
    assert evals[-1]["step"] == len(rows) and evals[-1]["retrieval_accuracy"] == 1.0
    report = json.loads((pretrained_dir("default") / "evaluation.json").read_text())
    shipped = next(iter(report["shipped"].values()))
    assert shipped["retrieval_accuracy"] == 1.0 and shipped["retrieval_accuracy_random_selection"] == 0.0


def test_plot_training_curves_marks_stages_and_curriculum(run_dir):
    fig = vtrain.plot_training_curves(run_dir)
    ax = fig.axes[0]
    texts = legend_texts(ax)
    for want in ("stage: dense", "stage: warmup", "stage: sparse", "easy-key curriculum ends (step 3)",
                 "retrieval answer loss", "next-token loss, all tokens", "indexer KL",
                 "retrieval accuracy, top-k (held-out)", "retrieval accuracy, dense"):
        assert want in texts, (want, texts)
    lm = next(line for line in ax.get_lines() if line.get_label() == "retrieval answer loss")
    rows, _, _ = fake_history()
    np.testing.assert_allclose(lm.get_ydata(), [r["lm"] for r in rows])
    kl = next(line for line in ax.get_lines() if line.get_label() == "indexer KL")
    assert list(kl.get_xdata()) == list(range(6, 12))
    boundaries = sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "--")
    assert boundaries == [5.5, 7.5]
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert ax.get_yscale() == "log" and "12 steps" in ax.get_title()
    render(fig)


def test_plot_training_curves_from_a_dict_of_lists_with_smoothing():
    rows, _, _ = fake_history()
    fig = vtrain.plot_training_curves({"lm": [r["lm"] for r in rows], "stage": [r["stage"] for r in rows]},
                                      easy_key_steps=2, smooth=3)
    ax = fig.axes[0]
    lm = next(line for line in ax.get_lines() if line.get_label() == "retrieval answer loss")
    assert len(lm.get_ydata()) == len(rows) - 2
    assert "easy-key curriculum ends (step 2)" in legend_texts(ax)
    render(fig)
