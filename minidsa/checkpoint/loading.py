"""Loading a model: a checkpoint directory (sharded safetensors + index JSON + config.json, docs/design.md §9)
or a preset's seeded random weights. This sits above the model; the file format is in formats/shards.py,
the names, shapes and dtypes a config implies in manifest.py.

    model.save_pretrained("ckpt", max_shard_size="50MB")
    model = minidsa.load("ckpt")

Tensor names are the real model's (``language_model.model.layers.{i}.self_attn.*``, routed experts as
``...block_sparse_moe.experts.{e}.w1.weight_packed`` uint8 [rows, K/2] and ``.weight_scale`` uint8
[rows, K/32]). Loading builds the model without initialising it, then streams shard by shard and
tensor by tensor, checking every name, shape and dtype against the config before copying; anything
missing, unexpected, malformed or truncated is an error that names the tensor or file. Each shard's
checksum (recorded in the index by save_pretrained) is verified before its data is used, and every
value is checked: floats finite, E8M0 scales neither NaN nor absurd.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import load_config
from ..formats import mxfp4, shards
from ..formats.dtypes import disk_dtype
from ..model.minidsa import MiniDSA
from .manifest import DEFAULT_MODEL, PRETRAINED, pretrained_dir, resolve_config

_EXPERT_TENSOR = re.compile(r"^(.*\.block_sparse_moe)\.experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale)$")
_DEFAULT_MODELS: dict[str, MiniDSA] = {}
_DEFAULT_LOCK = threading.Lock()


def load(name_or_path="tiny", *, device: torch.device | str = "cpu", progress: bool = True,
         lazy_experts: bool = False, config=None) -> MiniDSA:
    """A checkpoint directory (save_pretrained's output) with its weights, or the seeded random model
    of a preset name ("tiny", "laptop", ...), a config JSON path or a ModelConfig. ``progress`` shows a
    tqdm bar while a checkpoint streams in; ``lazy_experts`` leaves routed experts on disk until a
    token is routed to them. ``"default"`` is the trained checkpoint shipped with the package.

    A checkpoint's config is the one its index embeds and its config.json holds; if the two differ, loading
    is refused (a ValueError naming each differing field) until one wins explicitly: ``config`` (a config
    JSON path such as the directory's config.json, a preset name or a ModelConfig) is then the config the
    weights are loaded with, and must describe them like any other."""
    if isinstance(name_or_path, str) and name_or_path in PRETRAINED:
        name_or_path = pretrained_dir(name_or_path)
    if isinstance(name_or_path, (str, os.PathLike)) and str(name_or_path).strip() and Path(name_or_path).is_dir():
        return load_pretrained(name_or_path, device=device, progress=progress, lazy_experts=lazy_experts,
                               config=config)
    if isinstance(name_or_path, (str, os.PathLike)) and (Path(name_or_path).name == shards.INDEX_NAME
                                                          or Path(name_or_path).suffix == ".safetensors"):
        raise ValueError(f"{str(name_or_path)!r} is one file of a checkpoint; pass its directory, "
                         f"minidsa.load({str(Path(name_or_path).parent)!r})")
    if config is not None:
        raise ValueError(f"config= chooses the config of a checkpoint directory, and {str(name_or_path)!r} is "
                         f"none; for the seeded random model of a config pass it alone, minidsa.load(config)")
    return build_model(name_or_path, device=device)


def build_model(name_or_config="tiny", *, device: torch.device | str = "cpu") -> MiniDSA:
    """A seeded, randomly initialised model of the named config; ``build_model("default")`` has the shipped
    model's config and random weights (``load("default")`` is the trained one)."""
    return MiniDSA(resolve_config(name_or_config), device=device)


def default_model() -> MiniDSA:
    """The model ``generate`` uses when given none (built once per process)."""
    with _DEFAULT_LOCK:   # two threads' first generate() calls share one model, not two
        if DEFAULT_MODEL not in _DEFAULT_MODELS:
            _DEFAULT_MODELS[DEFAULT_MODEL] = load(DEFAULT_MODEL, progress=False)  # 2 MB: no bar needed
        return _DEFAULT_MODELS[DEFAULT_MODEL]


def load_pretrained(directory: str | os.PathLike, *, device: torch.device | str = "cpu",
                    progress: bool = True, lazy_experts: bool = False, config=None) -> MiniDSA:
    """Build the model of the checkpoint's config (``config`` if given, see ``load``) and fill it from the
    shards, verifying every tensor.

    With ``lazy_experts`` the routed experts' headers (name, shape, dtype) are checked now but their
    data is read from disk the first time a token is routed to them (their E8M0 codes are checked
    then), so loading costs I/O only for the dense part.
    """
    # The index's config and config.json, refused if they differ ('' is refused, not '.'); or the caller's.
    cfg = load_config(directory) if config is None else resolve_config(config)
    directory = Path(directory)
    weight_map, checksums = shards.read_index(directory)
    model = MiniDSA(cfg, device="meta", init=False).to_empty(device=device)
    expected = model.checkpoint_tensors()  # views into the model's own storage: copying fills the model
    dtypes = {name: disk_dtype(name, t, cfg.torch_dtype) for name, t in expected.items()}
    by_shard = _check_names(directory, weight_map, expected)
    moe_of = {f"language_model.model.layers.{i}.block_sparse_moe": layer.block_sparse_moe
              for i, layer in enumerate(model.language_model.model.layers) if layer.is_moe}
    for moe in moe_of.values() if lazy_experts else ():
        # Experts still on disk must not hold to_empty's garbage: a forward converts unrouted experts as
        # fixed-shape placeholders (gate 0), and 0 * a garbage NaN scale is NaN. Zero codes are finite.
        moe.experts.packed.zero_()
        moe.experts.scales.zero_()
    with tqdm(total=len(weight_map), unit="tensor", desc="loading", disable=not progress, leave=False) as bar:
        for fname in sorted(by_shard):
            verify = shards.checksum_verifier(directory / fname, checksums.get(fname))
            _load_shard(directory / fname, by_shard[fname], expected, dtypes, moe_of if lazy_experts else None,
                        verify, bar)
    _check_a_log_padding(expected, cfg.kda.num_heads)
    for moe in moe_of.values():
        moe.experts.resident[:] = not moe.experts.lazy_source
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


def _check_a_log_padding(expected: dict[str, torch.Tensor], num_heads: int) -> None:
    """The model reads the first num_heads entries of each KDA ``A_log``; the rest must be the release's
    zero padding. A non-zero tail means the checkpoint's layout is not the one assumed here."""
    for name, t in expected.items():
        if name.endswith(".A_log") and bool((t[num_heads:] != 0).any()):
            raise ValueError(f"tensor {name} has non-zero entries after its first {num_heads} (kda.num_heads); "
                             f"A_log is expected to be zero-padded to {t.shape[0]}")


def check_values(name: str, t: torch.Tensor) -> None:
    """A tensor read from a checkpoint: floats must be finite (a NaN lm_head would make greedy decoding
    emit byte 0, a NaN norm would surface layers later as "indexer scores contain NaN"); E8M0 scales
    must be neither NaN nor absurd. Raises ValueError naming the tensor."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):  # one pass; counting only on failure
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        raise ValueError(f"tensor {name} holds {nan} NaN and {inf} Inf value(s); the checkpoint is corrupt "
                         f"or was saved from a diverged model (re-save it from healthy weights)")
    if name.endswith(".weight_scale"):
        mxfp4.check_scales(t, name)


def _load_shard(path: Path, names: list[str], expected: dict, dtypes: dict, lazy_moe: dict | None,
                verify, bar) -> None:
    """Copy (or, for lazy experts, check the header of and register a reader for) each tensor of one shard.

    The shard's checksum is verified before its first tensor is copied; a shard holding only lazy
    experts is verified when its first expert is read (one pass over that shard)."""
    lazy = {name: m for name in names if lazy_moe is not None and (m := _EXPERT_TENSOR.match(name))}
    if len(lazy) < len(names):
        verify()
    seen = shards.file_identity(path) if lazy else None  # once per shard, for the lazy readers' check
    with shards.open_shard(path) as f:
        present = set(f.keys())
        if extra := sorted(present - set(names)):
            raise ValueError(f"shard {path.name} holds {len(extra)} tensor(s) that {shards.INDEX_NAME} does not "
                             f"list, e.g. {extra[:3]}: the index and the shard disagree; re-save the checkpoint")
        for name in names:
            if name not in present:
                raise ValueError(f"tensor {name} is listed in {shards.INDEX_NAME} under {path.name} "
                                 f"but the shard lacks it")
            target = expected[name]
            if name in lazy:  # header now, data on first use
                sl = f.get_slice(name)
                shards.check_header(name, sl.get_shape(), sl.get_dtype(), target.shape, dtypes[name])
                prefix, e, w, kind = lazy[name].groups()
                lazy_moe[prefix].experts.lazy_source[(int(e), w, kind)] = shards.tensor_reader(
                    path, name, target, dtypes[name], check_values, verify, seen)
            else:
                shards.store(name, path.name, lambda: f.get_tensor(name), target, dtypes[name], check_values)
            bar.update(1)
