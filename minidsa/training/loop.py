"""Training the model in miniature: the DSA recipe on the synthetic tasks (tasks.py), in resumable legs
(docs/design.md §2).

Stages (one run, one AdamW, one warm-up + cosine learning-rate schedule over all steps):
  0. dense   - the whole model learns the tasks with dense attention (the miniature's stand-in for the
               dense checkpoint that DSA training starts from); the indexer is unused;
  1. warmup  - attention stays dense and only the indexer learns, by KL to the main attention summed
               over heads (indexer_losses.layer_kl, stage "warmup");
  2. sparse  - attention uses the indexer's top-k; the model learns from the LM loss (and, when
               focus_loss_weight > 0, the focus term, indexer_losses.focus_loss) and the indexer
               from its KL over the selected keys with its input detached (stage "sparse").
The indexer's KL (stages 1 and 2) and the focus term take the MLA inputs of the retrieval rows and of
the multimodal rows: the indexer must learn where an answer about an image looks, too.
The LM loss is cross-entropy on the answer tokens (and eos) of each row, plus (text_loss_weight) a
next-token loss on every token of the retrieval rows; in stage 0 some pass keys are one repeated digit
(easy_key_*), which teaches "find the digits and copy them" before their order. Without these two the
answer loss stays at ln(10) per digit (the model learns the format, never the copy). Forward and backward run on
the lean training path (forward.py), equal to the reference forward.

    result = train(TrainConfig(model="tiny", out_dir="runs/tiny", sparse_steps=300))
    result = train(TrainConfig(out_dir="runs/tiny", max_minutes=9), resume=True)   # the next leg

``out_dir`` then holds a checkpoint in the package's format (save_pretrained: routed experts quantised
to MXFP4), ``training_state.safetensors`` (float master weights, optimizer state, step, history: what
resuming needs; state.py), ``training_log.json`` (the same history as JSON) and ``loss_curves.png``. ``TrainConfig.from_recipe``
names the two recipes: "shipped" (the default fields) and "quick" (retrieval in a few minutes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import load_config
from ..formats.shards import write_atomic
from ..model.minidsa import MiniDSA
from . import tasks
from .evaluation import evaluate, format_metrics, multimodal_logits
from .forward import TrainingModel
from .indexer_losses import focus_loss, layer_kl
from .state import LEGACY_STATE_FILE, STATE_FILE, load_state, save_state

CURVES_FILE = "loss_curves.png"
LOG_FILE = "training_log.json"  # the run's config, per-step losses and evaluations, readable without torch
# Settings of one leg, which a resumed run may change; every other field defines the run and is kept.
LEG_FIELDS = ("out_dir", "max_minutes", "leg_steps", "eval_every", "eval_n", "save_every", "device", "progress")


@dataclass
class TrainConfig:
    """One training run (the fields not in LEG_FIELDS are fixed when the run starts)."""

    model: str = "tiny"  # preset name or config JSON; training starts from its seeded initialisation
    out_dir: str = "runs/minidsa"  # checkpoint directory of the run (created; resumed from with resume=True)
    seed: int = 0  # seeds the data stream and the evaluation's random selections (the weights: config seed)
    dense_steps: int = 4400  # stage 0 steps: dense attention, everything but the indexer learns (the image task
    # is the slowest to learn and needs a dense stage this long)
    warmup_steps: int = 200  # stage 1 steps: dense attention, only the indexer learns (KL)
    sparse_steps: int = 1400  # stage 2 steps: top-k attention, LM loss + the indexer's KL (input detached)
    batch_size: int = 8  # retrieval rows per step
    mm_batch_size: int = 32  # multimodal rows per step (0 = none; a few rows per step are too few to learn the shapes)
    context: int = 72  # tokens per retrieval row (9 x tiny's top-k); 0 = tasks.default_context (16 x top-k, capped)
    num_distractors: int = 0  # extra pass-key passages with other names per retrieval row
    focus_loss_weight: float = 0.3  # sparse stage: weight of indexer_losses.focus_loss (0 = DSA's recipe as is)
    text_loss_weight: float = 1.0  # weight of a next-token loss on every token of the retrieval rows (0 = off)
    easy_key_steps: int = 150  # first steps on which every pass key is one digit repeated ("77777"): copying
    easy_key_frac: float = 0.25  # ... and the share of such rows afterwards (0 = none)
    lr: float = 3e-3  # peak AdamW learning rate (all parameters)
    min_lr_ratio: float = 0.3  # the cosine decays the learning rate to lr * min_lr_ratio at the last step
    lr_warmup: int = 30  # steps of linear learning-rate warm-up at the start of the run
    weight_decay: float = 0.01  # AdamW decoupled weight decay on matrices (not on 1-D gains and biases)
    grad_clip: float = 1.0  # max gradient norm, applied separately to the indexer and to the rest
    eval_every: int = 400  # steps between evaluations on held-out seeds (0 = only at the end of the run)
    eval_n: int = 64  # samples per task in each evaluation
    save_every: int = 0  # steps between checkpoints (0 = at the end of each leg only)
    max_minutes: float = 0.0  # end this leg after this wall time, saving a resumable checkpoint (0 = no limit)
    leg_steps: int = 0  # end this leg after this many steps, saving a resumable checkpoint (0 = no limit)
    device: str = "cpu"  # torch device of the run ("cuda" on a GPU)
    progress: bool = True  # show a tqdm bar

    @property
    def total_steps(self) -> int:
        return self.dense_steps + self.warmup_steps + self.sparse_steps

    @classmethod
    def from_recipe(cls, name: str, **overrides) -> TrainConfig:
        """The TrainConfig of a named recipe (RECIPES), with keyword overrides: ``from_recipe("quick", out_dir=d)``."""
        if name not in RECIPES:
            raise ValueError(f"recipe = {name!r}; use one of {sorted(RECIPES)}")
        return cls(**{**RECIPES[name], **overrides})

    def validate(self) -> None:
        for name in ("dense_steps", "warmup_steps", "sparse_steps", "easy_key_steps", "mm_batch_size", "context",
                     "num_distractors",
                     "lr_warmup", "eval_every", "save_every", "seed", "leg_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name} = {v!r} must be an int >= 0")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"TrainConfig.batch_size = {self.batch_size!r} must be an int >= 1")
        if self.total_steps < 1:
            raise ValueError("TrainConfig has no steps; set dense_steps, warmup_steps or sparse_steps > 0")
        if not (self.text_loss_weight >= 0 and self.focus_loss_weight >= 0 and 0 <= self.easy_key_frac <= 1):
            raise ValueError(f"TrainConfig needs text_loss_weight >= 0, focus_loss_weight >= 0 and 0 <= "
                             f"easy_key_frac <= 1; got {self.text_loss_weight}, {self.focus_loss_weight}, "
                             f"{self.easy_key_frac}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.grad_clip > 0 and self.max_minutes >= 0):
            raise ValueError(f"TrainConfig needs lr > 0, 0 <= min_lr_ratio <= 1, grad_clip > 0 and max_minutes >= 0; "
                             f"got lr={self.lr}, min_lr_ratio={self.min_lr_ratio}, grad_clip={self.grad_clip}, "
                             f"max_minutes={self.max_minutes}")


# Named recipes as TrainConfig overrides. "shipped" is the run behind minidsa/pretrained/default (about
# 65 min on 2 CPU cores). "quick" learns retrieval in under 2 min on one CPU thread: pass-key rows only
# (the image task needs thousands of steps), a smaller next-token weight (the filler competes with the
# copy for the tiny model's capacity) and a learning rate that decays to a tenth, which keeps the sparse
# stage from undoing what the dense stage learned (docs/design.md §2).
RECIPES: dict[str, dict] = {
    "shipped": {},
    "quick": {"dense_steps": 400, "warmup_steps": 60, "sparse_steps": 140, "mm_batch_size": 0,
              "text_loss_weight": 0.3, "min_lr_ratio": 0.1, "eval_every": 200, "eval_n": 32},
}


def stage_at(cfg: TrainConfig, step: int) -> str:
    """"dense", "warmup" or "sparse": the stage of step ``step`` (0-based)."""
    if step < cfg.dense_steps:
        return "dense"
    return "warmup" if step < cfg.dense_steps + cfg.warmup_steps else "sparse"


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over lr_warmup steps, then cosine from lr to lr * min_lr_ratio at the last step."""
    warm = min(1.0, (step + 1) / cfg.lr_warmup) if cfg.lr_warmup else 1.0
    frac = step / max(1, cfg.total_steps - 1)
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def param_groups(tm: TrainingModel, weight_decay: float) -> list[dict]:
    """Three AdamW groups: the indexers ("indexer"), the other matrices ("main") and the 1-D gains and biases
    ("no_decay"). Parameters without a gradient in a step (the indexer in stage 0, all but it in stage 1)
    are skipped by AdamW, weight decay included."""
    groups = {"indexer": [], "main": [], "no_decay": []}
    for name, p in tm.named_parameters():
        groups["indexer" if ".indexer." in name else "main" if p.dim() > 1 else "no_decay"].append(p)
    return [{"name": k, "params": v, "weight_decay": 0.0 if k == "no_decay" else weight_decay}
            for k, v in groups.items()]


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labelled positions: logits [B, T, V], labels [B, T] (-100 = none)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def text_loss(logits: torch.Tensor, input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Mean next-token cross-entropy over every non-pad token (filler, passage, question, answer, eos)."""
    targets = input_ids[:, 1:].masked_fill(input_ids[:, 1:] == pad_id, -100)
    return answer_loss(logits[:, :-1], targets)


def easy_keys(batch: list[tasks.Sample], cfg: TrainConfig, step: int) -> list[tasks.Sample]:
    """The copy curriculum: some rows get a key of one repeated digit (all of them before easy_key_steps),
    which a model can learn to copy before it learns the order of five different digits."""
    frac = 1.0 if step < cfg.easy_key_steps else cfg.easy_key_frac
    rng = np.random.default_rng([len(tasks.SPLITS), cfg.seed, step])  # its own stream, apart from the splits
    out = []
    for s in batch:
        if rng.random() < frac:
            key = str(int(rng.integers(10))) * tasks.KEY_DIGITS
            s = dataclasses.replace(s, prompt=s.prompt.replace(f" is {s.answer}.", f" is {key}.", 1), answer=key)
        out.append(s)
    return out


def step_losses(tm: TrainingModel, cfg: TrainConfig, step: int) -> dict[str, torch.Tensor]:
    """The losses of one step: "lm" (retrieval), "mm" (multimodal) and "kl" (indexer), as the stage defines
    them. Only the losses with a gradient are summed for backward; the others are logged."""
    stage, device, mcfg = stage_at(cfg, step), tm.model.device, tm.model.config
    context = cfg.context or tasks.default_context(mcfg)
    rows = tasks.samples("retrieval", "train", cfg.seed, step * cfg.batch_size, cfg.batch_size, context,
                        cfg.num_distractors)
    batch = tasks.encode(easy_keys(rows, cfg, step) if stage == "dense" else rows, mcfg)
    ids, labels = batch.input_ids.to(device), batch.labels.to(device)
    selection = "indexer" if stage == "sparse" else "dense"
    with torch.set_grad_enabled(stage != "warmup"):  # warm-up: the model is fixed, only the KL has a gradient
        logits, recorded = tm(ids, selection=selection, record=stage != "dense")
        out = {"lm": answer_loss(logits, labels)}
        if cfg.text_loss_weight and stage != "warmup":
            out["text"] = cfg.text_loss_weight * text_loss(logits, ids, tm.model.tokenizer.pad_id)
        inputs = list(recorded.items())  # (MLA layer, its input x): what the indexer losses see
        if cfg.mm_batch_size:
            mm = tasks.encode(tasks.samples("multimodal", "train", cfg.seed, step * cfg.mm_batch_size,
                                          cfg.mm_batch_size), mcfg)
            mm_logits, mm_recorded = multimodal_logits(tm, mm, selection, record=stage != "dense")
            out["mm"] = answer_loss(mm_logits, mm.labels.to(device))
            inputs += mm_recorded.items()  # the indexer must also learn where the answer looks in the image
    if stage != "dense":
        out["kl"] = torch.stack([layer_kl(mla, x, stage) for mla, x in inputs]).mean()
    if stage == "sparse" and cfg.focus_loss_weight:
        out["focus"] = cfg.focus_loss_weight * torch.stack([focus_loss(mla, x) for mla, x in inputs]).mean()
    return out


def train_step(tm: TrainingModel, opt: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> dict[str, float]:
    """One optimizer step; returns the logged losses, the learning rate and the stage."""
    for group in opt.param_groups:
        group["lr"] = lr_at(cfg, step)
    opt.zero_grad(set_to_none=True)  # None, not 0: AdamW then skips (and does not decay) what a stage freezes
    losses = step_losses(tm, cfg, step)
    sum(v for v in losses.values() if v.requires_grad).backward()
    for group in opt.param_groups:
        if group["name"] != "no_decay":  # no_decay is clipped together with main
            params = group["params"] + (opt.param_groups[2]["params"] if group["name"] == "main" else [])
            torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], cfg.grad_clip)
    opt.step()
    return {"step": step, "stage": stage_at(cfg, step), "lr": lr_at(cfg, step),
            **{k: v.item() for k, v in losses.items()}}


def train(config: TrainConfig | None = None, *, resume: bool = False, overwrite: bool = False, **overrides) -> dict:
    """Run (or, with ``resume``, continue from ``out_dir``) a training run; returns {"step", "history",
    "evals", "train_config", "out_dir", "done"}. Keyword overrides replace TrainConfig fields. On resume the
    run's fields come from the checkpoint and only the leg fields (LEG_FIELDS) of ``config`` apply, and a
    directory whose checkpoint and training state are of different models (files of two runs) is a
    ValueError naming the differing config fields or tensors. A fresh run refuses a directory that holds a
    run unless ``overwrite``; the directory is checked writable first."""
    cfg = dataclasses.replace(config or TrainConfig(), **overrides)
    cfg.validate()
    check_run_dir(Path(cfg.out_dir), fresh=not resume, overwrite=overwrite)
    tm, opt, step, log = _start(cfg, resume)
    if resume:
        cfg = dataclasses.replace(TrainConfig(**log["train_config"]), **{f: getattr(cfg, f) for f in LEG_FIELDS})
    start_time, first, done = time.perf_counter(), step, step
    bar = tqdm(range(step, cfg.total_steps), initial=step, total=cfg.total_steps, disable=not cfg.progress,
               desc="train", unit="step")
    for step in bar:
        log["history"].append(train_step(tm, opt, cfg, step))
        bar.set_postfix({k: f"{v:.3g}" for k, v in log["history"][-1].items() if k in ("lm", "mm", "kl")})
        done = step + 1
        if not cfg.progress and done % 50 == 0:  # without the bar, a line per 50 steps for logs of long legs
            rate = (done - first) / (time.perf_counter() - start_time)
            print(f"step {done}: " + ", ".join(f"{k} {v:.4g}" for k, v in log["history"][-1].items()
                                               if isinstance(v, float)) + f", {rate:.2f} steps/s", flush=True)
        if cfg.eval_every and done % cfg.eval_every == 0 or done == cfg.total_steps:
            log["evals"].append({"step": done, **evaluate(tm, seed=cfg.seed, n=cfg.eval_n, context=cfg.context or None,
                                                          num_distractors=cfg.num_distractors)})
            tqdm.write(f"step {done}: " + format_metrics(log["evals"][-1]).replace("\n", ", "))
        out_of_time = (cfg.max_minutes and time.perf_counter() - start_time > 60 * cfg.max_minutes
                       or cfg.leg_steps and done - first >= cfg.leg_steps)
        if done == cfg.total_steps or out_of_time or (cfg.save_every and done % cfg.save_every == 0):
            save(tm, opt, cfg, done, log)
        if out_of_time:
            break
    bar.close()
    return {"step": done, "history": log["history"], "evals": log["evals"], "train_config": log["train_config"],
            "out_dir": cfg.out_dir, "done": done == cfg.total_steps}


def check_run_dir(out: Path, fresh: bool, overwrite: bool = False) -> None:
    """Before any step: a fresh run's directory holds no run (unless ``overwrite``); the directory is writable."""
    held = [n for n in (STATE_FILE, LEGACY_STATE_FILE, LOG_FILE) if (out / n).is_file()]
    if fresh and held and not overwrite:
        raise ValueError(f"{str(out)!r} already holds a training run ({held[0]}); continue it with resume=True "
                         f"(--resume) or start over with overwrite=True (--overwrite)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise OSError(e.errno, f"cannot write the run directory {out} ({e.strerror}); choose another out_dir "
                               f"(--out) before training", str(out)) from None


def _start(cfg: TrainConfig, resume: bool):
    """(model wrapper, optimizer, first step, log) of a fresh run or of the checkpoint in out_dir. Resuming
    from a directory whose checkpoint and training state are of different models is a ValueError naming
    what differs (_check_same_config, _check_same_tensors), before anything is loaded into the model."""
    out = Path(cfg.out_dir)
    if resume:
        state, model_config = load_state(out), load_config(out)
        _check_same_config(out, model_config, state)
        tm = TrainingModel(MiniDSA(model_config))
        step, log = state["step"], {k: state[k] for k in ("history", "evals", "train_config")}
    else:
        tm, step = TrainingModel(MiniDSA(load_config(cfg.model))), 0
        log = {"history": [], "evals": [], "train_config": dataclasses.asdict(cfg)}
    # recorded so that a later leg can tell a replaced checkpoint by its config, not only by tensor shapes
    # (a run begun before this field was recorded gets it on its next save)
    log["model_config"] = tm.model.config.to_dict()
    if resume:
        _check_same_tensors(out, tm, state)
        tm.load_state_dict(state["model"])
    tm.to(cfg.device)
    opt = torch.optim.AdamW(param_groups(tm, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    if resume:
        opt.load_state_dict(state["optimizer"])
    return tm, opt, step, log


# Config fields that change neither the function the weights compute nor how training runs (a label, the
# initialisation a trained state replaces, serving capacity and schedule): a checkpoint and a training
# state that differ only in these are still one run's files.
RESUME_IGNORES = frozenset({"name", "seed", "init_std", "kv_block_size", "kv_num_blocks", "max_sequences",
                            "attn_res_two_phase", "moe.workspace_experts", "moe.offline_experts"})


def _check_same_config(out: Path, model_config, state: dict) -> None:
    """The config of the checkpoint in ``out`` equals the one the training state ``state`` (load_state)
    records, RESUME_IGNORES aside; a state written before the config was recorded passes (its tensors are
    checked once the model is built, _check_same_tensors). Checked before the model is built: a replaced
    checkpoint may be of a model too large to build."""
    if isinstance(state.get("model_config"), dict):
        fields = _config_differences(model_config.to_dict(), state["model_config"])
        if fields:
            raise _two_runs(out, _first(fields))


def _check_same_tensors(out: Path, tm: TrainingModel, state: dict) -> None:
    """The training state's tensors have the names, shapes and dtypes of ``tm``'s (built from the checkpoint's
    config), and its AdamW moments the shapes of their parameters: load_state_dict would otherwise fail with
    a traceback, or (the moments, which it does not check) the first step would."""
    own, saved = tm.state_dict(), state["model"]
    differ = [f"{k} {_shape(own[k])} (checkpoint) vs {_shape(saved[k])} (state)"
              for k in own if k in saved and (saved[k].shape != own[k].shape or saved[k].dtype != own[k].dtype)]
    missing = [k for k in own if k not in saved]
    extra = [k for k in saved if k not in own]
    groups = param_groups(tm, 0.0)  # the optimizer's grouping (torch numbers the parameters in this order)
    params = [p for g in groups for p in g["params"]]
    moments, saved_groups = state["optimizer"]["state"], state["optimizer"]["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
        differ.append(f"the optimizer's parameter groups' sizes {[len(g['params']) for g in groups]} (checkpoint) "
                      f"vs {[len(g['params']) for g in saved_groups]} (state)")
    differ += [f"optimizer.{i}.{k} {_shape(t)} (state) for a parameter of {_shape(params[i])}"
               for i, per_param in moments.items() if i < len(params)
               for k, t in per_param.items() if isinstance(t, torch.Tensor) and t.dim() > 0
               and t.shape != params[i].shape]
    parts = [f"{len(items)} {what}: {_first(items)}" for items, what in (
        (differ, "tensor(s) differ"), (missing, "tensor(s) of the checkpoint's model are missing from the state"),
        (extra, "tensor(s) of the state are not in the checkpoint's model")) if items]
    if parts:
        raise _two_runs(out, "; ".join(parts))


def _two_runs(out: Path, what: str) -> ValueError:
    """A run directory whose checkpoint and training state are of different models: files of two runs, one
    replaced or copied in. Resuming would fail mid-load or train another model than the checkpoint's."""
    return ValueError(f"the checkpoint in {str(out)!r} and its {STATE_FILE} are of different models: {what}; "
                      f"resuming needs one run's checkpoint and state: start a new run with another out_dir "
                      f"(--out), or start over in {str(out)!r} with overwrite=True (--overwrite, without --resume)")


def _config_differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """'hidden_size 64 (checkpoint) vs 128 (state)' for each field (dotted in the sections) that both
    ModelConfig dicts (the checkpoint's ``a``, the state's ``b``) hold and that differs, leaving out
    RESUME_IGNORES. A field only one side holds is one the other side's version of the package did not know,
    so it is not compared."""
    out = []
    for key in a.keys() & b.keys():
        name = prefix + key
        if isinstance(a[key], dict) and isinstance(b[key], dict):
            out += _config_differences(a[key], b[key], name + ".")
        elif name not in RESUME_IGNORES and a[key] != b[key]:
            out.append(f"{name} {a[key]!r} (checkpoint) vs {b[key]!r} (state)")
    return sorted(out)


def _shape(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _first(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def save(tm: TrainingModel, opt: torch.optim.Optimizer, cfg: TrainConfig, step: int, log: dict) -> Path:
    """The checkpoint (save_pretrained; routed experts quantised from the float masters), the training state,
    the log (LOG_FILE: config, per-step losses, evaluations) and the loss-curve PNG, all in ``cfg.out_dir``."""
    out = Path(cfg.out_dir)
    tm.export_experts()
    tm.model.save_pretrained(out)
    save_state(out / STATE_FILE, tm.state_dict(), opt.state_dict(), step, log)
    write_atomic(out / LOG_FILE, json.dumps({"step": step, **log}, indent=0) + "\n")
    plot_curves(log["history"], log["evals"]).savefig(out / CURVES_FILE, dpi=110)
    return out


def plot_curves(history: list[dict], evals: list[dict]):
    """Loss curves (log scale) per step, stage boundaries dashed, eval accuracies on a second axis -> Figure."""
    # a bare Figure, not pyplot: a file needs no display, and switching the backend here would stop a
    # notebook that called train() from showing its later figures
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for key, label in (("lm", "retrieval answer loss"), ("text", "next-token loss, all tokens"),
                       ("mm", "multimodal answer loss"), ("kl", "indexer KL"),
                       ("focus", "focus loss (weighted)")):
        pts = [(h["step"], h[key]) for h in history if key in h]
        if pts:
            ax.plot(*zip(*pts), label=label, lw=1)
    for a, b in zip(history, history[1:]):
        if a["stage"] != b["stage"]:
            ax.axvline(b["step"], ls="--", c="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if evals:
        ax2 = ax.twinx()
        for key, style in (("retrieval_accuracy", "o-"), ("multimodal_accuracy", "o-"),
                           ("retrieval_accuracy_dense", "x:"), ("multimodal_accuracy_dense", "x:")):
            pts = [(e["step"], e[key]) for e in evals if key in e]  # older logs lack the dense ones
            if pts:
                ax2.plot(*zip(*pts), style, ms=3, label=key)
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("accuracy (held-out)")
        ax2.legend(loc="center right", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig
