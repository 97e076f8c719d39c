"""Training curves of a run of ``minidsa.train`` (docs/design.md §2): the losses per step with the DSA
recipe's stages marked.

A run goes through three stages: "dense" (dense attention, the indexer unused), "warmup" (attention stays
dense, only the indexer learns by KL to the main attention) and "sparse" (attention uses the indexer's
top-k). During the first ``easy_key_steps`` of the dense stage every pass key is one repeated digit (the
copy curriculum). ``plot_training_curves`` shades the stages and marks that switch, so a learner can
read each loss against what was being trained at the time: the answer loss falling only after the
curriculum, the indexer KL appearing at the warm-up, the jump (or not) when attention turns sparse.

A run directory is read from its ``training_log.json`` (or, for runs written before that file, its
training state, through ``training/state.py``: nothing is unpickled). The shipped
model's directory, ``minidsa/pretrained/default``, holds the log of the run that made it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..training.loop import LOG_FILE
from ..training.state import LEGACY_STATE_FILE, STATE_FILE, load_state
from ._common import integer_axis, new_axes

LOSSES = (("lm", "retrieval answer loss"), ("text", "next-token loss, all tokens"), ("mm", "multimodal answer loss"),
          ("kl", "indexer KL"), ("focus", "focus loss (weighted)"))
STAGE_COLOURS = {"dense": "0.85", "warmup": "#f6e3a1", "sparse": "#cfe8cf"}
# Held-out accuracies with the indexer's top-k and with dense attention: in the dense stage the indexer is
# untrained, so only the dense ones show what the model has learned by then.
ACCURACIES = (("retrieval_accuracy", "retrieval accuracy, top-k (held-out)", "o-", "0.2"),
              ("retrieval_accuracy_dense", "retrieval accuracy, dense", "x:", "0.2"),
              ("retrieval_digit_accuracy", "pass-key digits right, top-k (chance 0.1)", "d-.", "tab:cyan"),
              ("multimodal_accuracy", "multimodal accuracy, top-k (held-out)", "s--", "tab:brown"),
              ("multimodal_accuracy_dense", "multimodal accuracy, dense", "+:", "tab:brown"))


def load_history(history) -> tuple[list[dict], list[dict], dict]:
    """(per-step records, evaluations, train config or {}) of a run directory (or its training log or state file),
    the dict ``train`` returns, a list of per-step dicts, or a dict of equal-length lists."""
    if isinstance(history, (str, Path)):
        state = _read_run(Path(history))
        return list(state["history"]), list(state.get("evals", [])), dict(state.get("train_config", {}))
    if isinstance(history, dict) and "history" in history:
        return list(history["history"]), list(history.get("evals", [])), dict(history.get("train_config", {}))
    if isinstance(history, dict):
        n = {len(v) for v in history.values()}
        if len(n) != 1:
            raise ValueError(f"a dict of lists needs lists of one length, got lengths {sorted(n)}")
        rows = [{k: v[i] for k, v in history.items()} for i in range(n.pop())]
        for i, row in enumerate(rows):
            row.setdefault("step", i)
        return rows, [], {}
    if isinstance(history, (list, tuple)) and all(isinstance(r, dict) for r in history):
        return [{"step": i, **r} for i, r in enumerate(history)], [], {}
    raise TypeError(f"history must be a run directory, train()'s result, a list of dicts or a dict of lists, "
                    f"got {type(history).__name__}")


def _read_run(path: Path) -> dict:
    """The log of a run directory (LOG_FILE, else its training state) or of one of those files."""
    if path.is_dir() and (path / LOG_FILE).is_file():
        path = path / LOG_FILE
    if path.is_file() and path.suffix == ".json":
        return json.loads(path.read_text())
    run_dir = path.parent if path.is_file() else path
    if not (run_dir / STATE_FILE).is_file() and not (run_dir / LEGACY_STATE_FILE).is_file():
        raise ValueError(f"no {LOG_FILE} or {STATE_FILE} at {str(path)!r}: pass a run directory written by "
                         f"minidsa.train (or minidsa/pretrained/default, the shipped model's)")
    return load_state(run_dir)


def stage_spans(records: list[dict], config: dict) -> list[tuple[str, int, int]]:
    """[(stage, first step, last step + 1)] in order: from each record's "stage", else from the config's
    dense_steps / warmup_steps."""
    steps = [int(r["step"]) for r in records]
    if not steps:
        return []
    if all("stage" in r for r in records):
        stages = [r["stage"] for r in records]
    elif "dense_steps" in config:
        d, w = config["dense_steps"], config.get("warmup_steps", 0)
        stages = ["dense" if s < d else "warmup" if s < d + w else "sparse" for s in steps]
    else:
        return []
    spans = []
    for step, stage in zip(steps, stages):
        if spans and spans[-1][0] == stage:
            spans[-1][2] = step + 1
        else:
            spans.append([stage, step, step + 1])
    return [tuple(s) for s in spans]


def _smoothed(values: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or values.size < window:
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid")


def _mark_stages(ax, spans, easy_key_steps: int | None, last_step: int) -> None:
    for stage, a, b in spans:
        ax.axvspan(a - 0.5, b - 0.5, color=STAGE_COLOURS.get(stage, "0.95"), alpha=0.6, lw=0, zorder=0,
                   label=f"stage: {stage}")
    for _, a, _ in spans[1:]:
        ax.axvline(a - 0.5, color="0.3", ls="--", lw=0.8, zorder=1)
    if easy_key_steps and easy_key_steps <= last_step:
        ax.axvline(easy_key_steps - 0.5, color="tab:purple", ls=":", lw=1.2,
                   label=f"easy-key curriculum ends (step {easy_key_steps})")


def plot_training_curves(history, *, easy_key_steps: int | None = None, smooth: int = 1, log: bool = True,
                         ax=None):
    """Losses per step (log scale; ``smooth``-step running mean), stages shaded, the easy-key switch dotted
    (``easy_key_steps`` from the run's config unless given), held-out accuracies on a second axis."""
    records, evals, config = load_history(history)
    if not records:
        raise ValueError("the history has no steps to draw")
    easy = config.get("easy_key_steps") if easy_key_steps is None else easy_key_steps
    fig, ax = new_axes(ax, (9, 4.5))
    steps = np.array([int(r["step"]) for r in records])
    _mark_stages(ax, stage_spans(records, config), easy, int(steps.max()))
    for key, label in LOSSES:
        pts = [(int(r["step"]), float(r[key])) for r in records if key in r]
        if pts:
            x, y = np.array(pts).T
            ax.plot(x[smooth - 1:] if smooth > 1 and x.size >= smooth else x, _smoothed(y, smooth), lw=1.2, label=label)
    if log:
        ax.set_yscale("log")
    ax.set_xlim(steps.min() - 0.5, max([int(steps.max())] + [int(e["step"]) for e in evals]) + 0.5)
    integer_axis(ax, "x")
    ax.set_xlabel("step")
    ax.set_ylabel("loss" + (f" ({smooth}-step running mean)" if smooth > 1 else ""))
    handles, labels = ax.get_legend_handles_labels()
    if evals:
        ax2 = ax.twinx()
        for key, label, style, colour in ACCURACIES:
            if key.startswith("multimodal") and config.get("mm_batch_size") == 0:
                continue   # a run without image rows: its multimodal accuracy is 0 by construction
            pts = [(e["step"], e[key]) for e in evals if key in e]
            if pts:
                ax2.plot(*zip(*pts), style, color=colour, ms=4, lw=0.8, label=label)
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("accuracy")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.13 if evals else 1.01, 1))
    ax.set_title(f"Training curves ({len(records)} steps)")
    fig.tight_layout()
    return fig


__all__ = ["load_history", "plot_training_curves", "stage_spans"]
