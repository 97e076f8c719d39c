"""Sharded safetensors on disk: writing shards + the index JSON, and reading tensors back verified.

Nothing here knows the model: ``checkpoint.py`` (above the model) maps the model's tensors to names
and calls these; the MoE layer receives readers made by ``tensor_reader`` for its lazy experts.

    directory/model-0000N-of-0000M.safetensors   tensors, at most ~max_shard_size bytes per shard
    directory/model.safetensors.index.json      {"metadata": {"total_size": bytes}, "weight_map": {name: shard}}
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.float32: "F32",
                      torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16"}


def parse_size(size) -> int:
    """A positive int of bytes, or a string like '50MB' / '5GiB' -> bytes."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, flags=re.I)
        if m:
            unit = (m.group(2) or "B").upper()
            mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
            return max(1, int(float(m.group(1)) * mult))
    raise ValueError(f"max_shard_size = {size!r}; use a positive int of bytes or a string like '50MB' or '5GB'")


def write_shards(tensors: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str) -> None:
    """Write ``tensors`` (name -> tensor, in order) as numbered shards plus the index JSON."""
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():  # a tensor larger than the limit gets a shard of its own
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().cpu().contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2) + "\n")


def read_index(directory: Path) -> dict[str, str]:
    """weight_map of ``directory``'s index, with an error naming what is wrong."""
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise ValueError(f"{directory} has no {INDEX_NAME}, so it is not a minidsa checkpoint; save one with "
                         f"model.save_pretrained(dir) or pass a preset name / config JSON path")
    try:
        return json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"malformed {index_path}: {e}") from None


def open_shard(path: Path):
    """A safetensors handle (use as a context manager); unreadable headers become ValueError."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt headers
        raise ValueError(f"cannot read shard {path.name}: {e} (truncated or corrupt file?)") from None


def check_header(name: str, shape, dtype, target: torch.Tensor) -> None:
    """The stored shape and dtype of tensor ``name`` must be those of ``target``."""
    if tuple(shape) != tuple(target.shape):
        raise ValueError(f"tensor {name} has shape {tuple(shape)}, expected {tuple(target.shape)}")
    if dtype != target.dtype and dtype != SAFETENSORS_DTYPES.get(target.dtype):
        raise ValueError(f"tensor {name} has dtype {dtype}, expected {target.dtype}")


def store(name: str, fname: str, read: Callable[[], torch.Tensor], target: torch.Tensor) -> None:
    """t = read(); check its shape, dtype and (for E8M0 scales) NaN codes; copy it into ``target``."""
    try:
        t = read()
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"cannot read tensor {name} from {fname}: {e} (truncated or corrupt file?)") from None
    check_header(name, t.shape, t.dtype, target)
    if name.endswith(".weight_scale") and bool((t == 0xFF).any()):
        raise ValueError(f"tensor {name} holds the E8M0 NaN code 0xFF; the checkpoint is corrupt")
    with torch.no_grad():
        target.copy_(t)


def tensor_reader(path: Path, name: str, target: torch.Tensor) -> Callable[[], None]:
    """A zero-argument function that reads ``name`` from the shard at ``path`` into ``target``, checked
    as at load (the MoE layer calls it when an expert is first routed)."""
    def read() -> torch.Tensor:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    return lambda: store(name, path.name, read, target)
