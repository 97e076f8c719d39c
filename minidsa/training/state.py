"""The training state on disk: what resuming a run needs, in a format that cannot run code.

    runs/x/training_state.safetensors   tensors: "model.<name>" (the float masters), "optimizer.<i>.<key>"
                                        (AdamW's moments and step per parameter); metadata: "minidsa" (the
                                        format tag), "step", "param_groups" and "log" (history, evaluations,
                                        the run's TrainConfig, the model's config) as JSON

A pickle (``torch.save``) would run whatever code a stranger's run directory holds when loaded; safetensors
holds tensors and strings only. The file is written under a temporary name and renamed over the old one,
so a kill mid-write leaves the previous leg's state. Runs saved before this format (``training_state.pt``)
are read with ``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..formats.shards import new_file_mode, set_mode

STATE_FILE = "training_state.safetensors"
LEGACY_STATE_FILE = "training_state.pt"  # the earlier torch.save format: read only, without unpickling code
FORMAT = "minidsa-training-state-1"


def save_state(path: Path, model_state: dict, optimizer_state: dict, step: int, log: dict) -> None:
    """Write the state atomically (temporary file, then a rename over ``path``), with the mode open() gives a
    new file in its directory (0o666 less the umask), as the run's other files have."""
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model_state.items()}
    for i, per_param in optimizer_state["state"].items():
        tensors.update({f"optimizer.{i}.{k}": v.detach().cpu().contiguous() for k, v in per_param.items()})
    meta = {"minidsa": FORMAT, "step": str(step), "param_groups": json.dumps(optimizer_state["param_groups"]),
            "log": json.dumps(log)}
    tmp = path.with_name(f".{path.name}.partial")
    mode = new_file_mode(tmp)  # what open() gives a new file here: safetensors creates its files 0600
    save_file(tensors, str(tmp), metadata=meta)
    set_mode(tmp, mode)  # so the state is as readable as the run's other files
    os.replace(tmp, path)


def load_state(directory: Path) -> dict:
    """{"step", "model", "optimizer", "history", "evals", "train_config", "model_config"} of the run in
    ``directory``; a missing, truncated or foreign file is a ValueError naming it. "model_config" (the
    ModelConfig dict the state's tensors belong to) is None for states written before it was recorded."""
    path = directory / STATE_FILE
    if not path.is_file() and (directory / LEGACY_STATE_FILE).is_file():
        return _load_legacy(directory / LEGACY_STATE_FILE)
    if not path.is_file():
        raise ValueError(f"no {STATE_FILE} in {str(directory)!r} to resume from; train without --resume first")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("minidsa") != FORMAT:
                raise ValueError(f"{path} is not a minidsa training state (format tag {meta.get('minidsa')!r})")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        log = json.loads(meta["log"])
        optimizer: dict = {"state": {}, "param_groups": json.loads(meta["param_groups"])}
        for key, t in tensors.items():
            if key.startswith("optimizer."):
                _, i, name = key.split(".", 2)
                optimizer["state"].setdefault(int(i), {})[name] = t
        return {"step": int(meta["step"]), "optimizer": optimizer,
                "model": {k[len("model."):]: t for k, t in tensors.items() if k.startswith("model.")},
                "history": log["history"], "evals": log["evals"], "train_config": log["train_config"],
                "model_config": log.get("model_config")}
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
        raise _damaged(path, e) from None


def run_config(directory: Path) -> dict:
    """The run's TrainConfig fields, from the state's metadata alone (no tensor is read)."""
    path = directory / STATE_FILE
    if not path.is_file():
        return load_state(directory)["train_config"]  # a legacy state, or the error naming what is missing
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {})["log"])["train_config"]
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
        raise _damaged(path, e) from None


def _damaged(path: Path, e: Exception) -> ValueError:
    return ValueError(f"{path} is damaged or incomplete ({type(e).__name__}: {e}); resume from an earlier copy or "
                      f"train again without --resume")


def _load_legacy(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- the unpickler raises many kinds; all mean "not loadable safely"
        raise ValueError(f"{path} cannot be read safely ({type(e).__name__}: {str(e)[:200]}); a training state "
                         f"holding anything but tensors and plain data is refused, since loading it could run "
                         f"code") from None
