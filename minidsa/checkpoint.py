"""Loading a model: a checkpoint directory (sharded safetensors + index JSON + config.json, docs/design.md §9)
or a preset's seeded random weights. This sits above the model; the file format is in shards.py.

    model.save_pretrained("ckpt", max_shard_size="50MB")
    model = minidsa.load("ckpt")

Tensor names are the real model's (``language_model.model.layers.{i}.self_attn.*``, routed experts as
``...block_sparse_moe.experts.{e}.w1.weight_packed`` uint8 [rows, K/2] and ``.weight_scale`` uint8
[rows, K/32]). Loading builds the model without initialising it, then streams shard by shard and
tensor by tensor, checking every name, shape and dtype against the config before copying; anything
missing, unexpected, malformed or truncated is an error that names the tensor or file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import shards
from .config import load_config
from .model import MiniDSA

_EXPERT_TENSOR = re.compile(r"^(.*\.block_sparse_moe)\.experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale)$")
_DEFAULT_MODELS: dict[str, MiniDSA] = {}
DEFAULT_MODEL = "tiny"  # no trained weights ship yet: the default is the seeded tiny model


def load(name_or_path="tiny", *, device: torch.device | str = "cpu", progress: bool = True,
         lazy_experts: bool = False) -> MiniDSA:
    """A checkpoint directory (save_pretrained's output) with its weights, or the seeded random model
    of a preset name ("tiny", "laptop", ...), a config JSON path or a ModelConfig. ``progress`` shows a
    tqdm bar while a checkpoint streams in; ``lazy_experts`` leaves routed experts on disk until a
    token is routed to them."""
    if isinstance(name_or_path, (str, os.PathLike)) and Path(name_or_path).is_dir():
        return load_pretrained(name_or_path, device=device, progress=progress, lazy_experts=lazy_experts)
    return build_model(name_or_path, device=device)


def build_model(name_or_config="tiny", *, device: torch.device | str = "cpu") -> MiniDSA:
    """A seeded, randomly initialised model of the named config (no trained weights ship yet)."""
    return MiniDSA(load_config(name_or_config), device=device)


def count_parameters(name_or_config) -> dict[str, int]:
    """Total and per-token active parameters of any config, built on the meta device (no memory)."""
    model = MiniDSA(load_config(name_or_config), device="meta")
    return {"total": model.num_parameters(), "active": model.num_active_parameters()}


def default_model() -> MiniDSA:
    """The model ``generate`` uses when given none (built once per process)."""
    if DEFAULT_MODEL not in _DEFAULT_MODELS:
        _DEFAULT_MODELS[DEFAULT_MODEL] = load(DEFAULT_MODEL)
    return _DEFAULT_MODELS[DEFAULT_MODEL]


def load_pretrained(directory: str | os.PathLike, *, device: torch.device | str = "cpu",
                    progress: bool = True, lazy_experts: bool = False) -> MiniDSA:
    """Build the model of ``directory/config.json`` and fill it from the shards, verifying every tensor.

    With ``lazy_experts`` the routed experts' headers (name, shape, dtype) are checked now but their
    data is read from disk the first time a token is routed to them (their E8M0 codes are checked
    then), so loading costs I/O only for the dense part.
    """
    directory = Path(directory)
    cfg = load_config(directory / "config.json")
    weight_map = shards.read_index(directory)
    model = MiniDSA(cfg, device="meta", init=False).to_empty(device=device)
    expected = model.checkpoint_tensors()  # views into the model's own storage: copying fills the model
    by_shard = _check_names(directory, weight_map, expected)
    moe_of = {f"language_model.model.layers.{i}.block_sparse_moe": layer.block_sparse_moe
              for i, layer in enumerate(model.language_model.model.layers) if layer.is_moe}
    with tqdm(total=len(weight_map), unit="tensor", desc="loading", disable=not progress, leave=False) as bar:
        for fname in sorted(by_shard):
            _load_shard(directory / fname, by_shard[fname], expected, moe_of if lazy_experts else None, bar)
    for moe in moe_of.values():
        moe.resident[:] = not moe.lazy_source
    if cfg.moe.offline_experts:
        model.set_expert_mode("offline")
    return model


def _check_names(directory: Path, weight_map: dict[str, str], expected: dict) -> dict[str, list[str]]:
    """Every expected tensor listed, nothing unexpected, every shard present -> {shard file: names}."""
    missing = sorted(set(expected) - set(weight_map))
    if missing:
        raise ValueError(f"checkpoint {directory} is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    unexpected = sorted(set(weight_map) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint {directory} has tensors this config does not define, e.g. {unexpected[:3]} "
                         f"(wrong config.json?)")
    by_shard: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_shard.setdefault(fname, []).append(name)
    for fname in by_shard:
        if not (directory / fname).is_file():
            raise ValueError(f"shard {fname} listed in {shards.INDEX_NAME} is missing from {directory}")
    return by_shard


def _load_shard(path: Path, names: list[str], expected: dict, lazy_moe: dict | None, bar) -> None:
    """Copy (or, for lazy experts, check the header of and register a reader for) each tensor of one shard."""
    with shards.open_shard(path) as f:
        present = set(f.keys())
        for name in names:
            if name not in present:
                raise ValueError(f"tensor {name} is listed in {shards.INDEX_NAME} under {path.name} "
                                 f"but the shard lacks it")
            target = expected[name]
            expert = _EXPERT_TENSOR.match(name) if lazy_moe is not None else None
            if expert is not None:  # header now, data on first use
                sl = f.get_slice(name)
                shards.check_header(name, sl.get_shape(), sl.get_dtype(), target)
                prefix, e, w, kind = expert.groups()
                lazy_moe[prefix].lazy_source[(int(e), w, kind)] = shards.tensor_reader(path, name, target)
            else:
                shards.store(name, path.name, lambda: f.get_tensor(name), target)
            bar.update(1)
