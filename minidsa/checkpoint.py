"""Checkpoints in the real format: sharded safetensors + index JSON + config.json (SPEC section 9).

    model.save_pretrained("ckpt", max_shard_size="50MB")
    model = minidsa.load("ckpt")

Tensor names are the real model's (``language_model.model.layers.{i}.self_attn.*``, routed experts as
``...block_sparse_moe.experts.{e}.w1.weight_packed`` uint8 [rows, K/2] and ``.weight_scale`` uint8
[rows, K/32]). Loading builds the model without initialising it, then streams shard by shard and
tensor by tensor, checking every name, shape and dtype against the config before copying; anything
missing, unexpected, malformed or truncated is an error that names the tensor or file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from .config import load_config
from .model import MiniDSA

INDEX_NAME = "model.safetensors.index.json"
_EXPERT_BUFFER = re.compile(r"^(.*\.block_sparse_moe)\.(w[123])_(packed|scale)$")
_SUFFIX = {"packed": "weight_packed", "scale": "weight_scale"}


def checkpoint_tensors(model: MiniDSA) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by its real name (stacked expert buffers split per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        m = _EXPERT_BUFFER.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, w, kind = m.groups()
        for e in range(t.shape[0]):
            out[f"{prefix}.experts.{e}.{w}.{_SUFFIX[kind]}"] = t[e]
    return out


def _parse_size(size) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, flags=re.I)
        if m:
            unit = (m.group(2) or "B").upper()
            mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
            return max(1, int(float(m.group(1)) * mult))
    raise ValueError(f"max_shard_size = {size!r}; use a positive int of bytes or a string like '50MB' or '5GB'")


def save_pretrained(model: MiniDSA, directory: str | os.PathLike, max_shard_size: int | str = "2GB") -> Path:
    """Write config.json, model-0000N-of-0000M.safetensors shards and model.safetensors.index.json."""
    from safetensors.torch import save_file

    limit = _parse_size(max_shard_size)
    model.materialize_experts()  # a lazily loaded model reads its remaining experts first
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():  # a tensor larger than the limit gets a shard of its own
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().cpu().contiguous()
        size += nbytes
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2) + "\n")
    model.config.to_json(directory / "config.json")
    return directory


_SAFETENSORS_DTYPES = {torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.float32: "F32",
                       torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16"}
_EXPERT_TENSOR = re.compile(r"^(.*\.block_sparse_moe)\.experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale)$")


def _check(name: str, shape, dtype, target: torch.Tensor) -> None:
    if tuple(shape) != tuple(target.shape):
        raise ValueError(f"tensor {name} has shape {tuple(shape)}, expected {tuple(target.shape)}")
    if dtype != target.dtype and dtype != _SAFETENSORS_DTYPES.get(target.dtype):
        raise ValueError(f"tensor {name} has dtype {dtype}, expected {target.dtype}")


def _store(name: str, fname: str, read, target: torch.Tensor) -> None:
    """t = read(); check its shape, dtype and (for E8M0 scales) NaN codes; copy it into ``target``."""
    try:
        t = read()
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"cannot read tensor {name} from {fname}: {e} (truncated or corrupt file?)") from None
    _check(name, t.shape, t.dtype, target)
    if name.endswith(".weight_scale") and bool((t == 0xFF).any()):
        raise ValueError(f"tensor {name} holds the E8M0 NaN code 0xFF; the checkpoint is corrupt")
    with torch.no_grad():
        target.copy_(t)


def read_tensor(path: Path, name: str, target: torch.Tensor) -> None:
    """Read ``name`` from the shard at ``path`` into ``target`` (checked as at load)."""
    from safetensors import safe_open

    def read():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_tensor(name)
    _store(name, path.name, read, target)


def load_pretrained(directory: str | os.PathLike, *, device: torch.device | str = "cpu",
                    progress: bool = True, lazy_experts: bool = False) -> MiniDSA:
    """Build the model of ``directory/config.json`` and fill it from the shards, verifying every tensor.

    With ``lazy_experts`` the routed experts' headers (name, shape, dtype) are checked now but their
    data is read from disk the first time a token is routed to them (their E8M0 codes are checked
    then), so loading costs I/O only for the dense part.
    """
    from safetensors import safe_open
    from tqdm.auto import tqdm

    directory = Path(directory)
    cfg = load_config(directory / "config.json")
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise ValueError(f"{directory} has no {INDEX_NAME}, so it is not a minidsa checkpoint; save one with "
                         f"model.save_pretrained(dir) or pass a preset name / config JSON path")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"malformed {index_path}: {e}") from None
    model = MiniDSA(cfg, device="meta", init=False).to_empty(device=device)
    expected = checkpoint_tensors(model)  # views into the model's own storage: copying fills the model
    missing = sorted(set(expected) - set(weight_map))
    if missing:
        raise ValueError(f"checkpoint {directory} is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    unexpected = sorted(set(weight_map) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint {directory} has tensors this config does not define, e.g. {unexpected[:3]} "
                         f"(wrong config.json?)")
    shards: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        shards.setdefault(fname, []).append(name)
    for fname in shards:
        if not (directory / fname).is_file():
            raise ValueError(f"shard {fname} listed in {INDEX_NAME} is missing from {directory}")
    moe_of = {f"language_model.model.layers.{i}.block_sparse_moe": layer.block_sparse_moe
              for i, layer in enumerate(model.language_model.model.layers) if layer.is_moe}
    loaded = 0
    bar = tqdm(total=len(weight_map), unit="tensor", desc="loading", disable=not progress, leave=False)
    for fname in sorted(shards):
        path = directory / fname
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt headers
            raise ValueError(f"cannot read shard {fname}: {e} (truncated or corrupt file?)") from None
        with handle as f:
            present = set(f.keys())
            for name in shards[fname]:
                if name not in present:
                    raise ValueError(f"tensor {name} is listed in {INDEX_NAME} under {fname} but the shard lacks it")
                target = expected[name]
                expert = _EXPERT_TENSOR.match(name) if lazy_experts else None
                if expert is not None:  # header now, data on first use
                    sl = f.get_slice(name)
                    _check(name, sl.get_shape(), sl.get_dtype(), target)
                    prefix, e, w, kind = expert.groups()
                    moe_of[prefix].lazy_source[(int(e), w, kind)] = (path, name, target)
                else:
                    _store(name, fname, lambda: f.get_tensor(name), target)
                loaded += target.numel()
                bar.update(1)
    bar.close()
    if loaded != sum(t.numel() for t in expected.values()):
        raise ValueError(f"loaded {loaded} values but the config defines {sum(t.numel() for t in expected.values())}")
    for moe in moe_of.values():
        moe.resident[:] = not moe.lazy_source
    if cfg.moe.offline_experts:
        model.set_expert_mode("offline")
    return model
