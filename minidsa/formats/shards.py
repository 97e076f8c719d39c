"""Sharded safetensors on disk: writing shards + the index JSON, and reading tensors back verified.

Nothing here knows the model: ``checkpoint/loading.py`` (above the model) maps the model's tensors to names
and calls these; the MoE layer receives readers made by ``tensor_reader`` for its lazy experts.

    directory/model-0000N-of-0000M.safetensors   tensors, at most ~max_shard_size bytes per shard
    directory/model.safetensors.index.json      {"metadata": {"total_size": bytes, "checksums": {shard: "sha256:hex"}},
                                                 "weight_map": {name: shard}}

The checksum covers a shard file's bytes, header and data: it catches flipped bits that every
structural check misses (a flipped mantissa bit is still a valid number). Checkpoints without
checksums (older minidsa, other tools) load unverified.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .dtypes import SAFETENSORS_NAMES

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
TMP_SUFFIX = ".partial"  # a file being written: renamed into place when complete
KEPT_PREFIX = ".previous-"  # the second name of an old shard while a new checkpoint is written over it
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # what write_shards names its shards
CHECKSUM = "sha256"  # hashlib's sha256 uses the CPU's SHA extensions: about 1 s per GB here, the fastest stdlib hash
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header
ITEM_BYTES = {"U8": 1, "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def parse_size(size) -> int:
    """A positive int of bytes, or a string like '50MB' / '5GiB' -> bytes."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, flags=re.I)
        if m:
            unit = (m.group(2) or "B").upper()
            mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
            if (n := int(float(m.group(1)) * mult)) > 0:
                return n
    raise ValueError(f"max_shard_size = {size!r}; use a positive int of bytes or a string like '50MB' or '5GB'")


class Index(NamedTuple):
    """A checkpoint's index JSON: which shard holds each tensor, and each shard's checksum (may be empty)."""

    weight_map: dict[str, str]
    checksums: dict[str, str]


def write_shards(tensors: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str,
                 config_text: str) -> None:
    """Write ``tensors`` (name -> tensor, in order) as numbered shards, the index JSON (each shard's checksum,
    and ``config_text``, the config.json it belongs with) and config.json, so that a kill or a full disk at any
    point leaves the directory loadable as the old checkpoint or as the new one:

    1. the old checkpoint's shards get a second name (a hard link, or a copy) and the old index is rewritten
       to point at those: the old checkpoint stays whole while its usual names are overwritten;
    2. the new shards are written under temporary names and renamed into place;
    3. the new index is renamed over the old one: the commit. A reader of the directory takes the config
       embedded in the index (``index_config``), so a kill before config.json is replaced is harmless;
    4. config.json is replaced; the old shards and any leftovers of an interrupted save are removed.
    """
    limit = check_shard_size(tensors, max_shard_size)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append({})
            size = 0
        groups[-1][name] = t.detach().cpu().contiguous()
        size += nbytes
    _keep_old_checkpoint(directory)
    weight_map, checksums = {}, {}
    for i, group in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tmp = directory / f".{fname}{TMP_SUFFIX}"
        try:
            save_file(group, str(tmp), metadata={"format": "pt"})
        except SafetensorError as e:  # safetensors reports a failed write in its own type: make it an OSError
            raise OSError(errno.EIO, f"cannot write shard {fname} ({e})", str(tmp)) from None
        checksums[fname] = file_checksum(tmp)  # re-read from the page cache: about 1 s per GB
        os.replace(tmp, directory / fname)
        weight_map.update({name: fname for name in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_atomic(directory / INDEX_NAME, _index_text(weight_map, checksums, total, config_text))
    write_atomic(directory / CONFIG_NAME, config_text)
    for path in directory.iterdir():  # what the new index does not list: old shards, their second names
        if (SHARD_NAME.fullmatch(path.name) and path.name not in checksums or path.name.startswith(KEPT_PREFIX)
                or path.name.startswith(".model-") and path.name.endswith(TMP_SUFFIX)):
            path.unlink()


def _index_text(weight_map: dict, checksums: dict, total: int, config_text: str | None) -> str:
    meta = {"total_size": total, "checksums": checksums}
    if config_text is not None:
        meta["config"] = config_text
    return json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2) + "\n"


def _keep_old_checkpoint(directory: Path) -> None:
    """Step 1 of write_shards: give the old shards a second name and point the old index at it."""
    try:
        old = json.loads((directory / INDEX_NAME).read_text())
        weight_map, meta = dict(old["weight_map"]), dict(old.get("metadata", {}))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # no readable checkpoint here: nothing to keep
    kept = {}
    for fname in sorted(set(weight_map.values())):
        if not (directory / fname).is_file() or fname.startswith(KEPT_PREFIX):
            continue
        kept[fname] = KEPT_PREFIX + fname
        (directory / kept[fname]).unlink(missing_ok=True)
        try:
            os.link(directory / fname, directory / kept[fname])
        except OSError:  # a file system without hard links
            shutil.copyfile(directory / fname, directory / kept[fname])
    if not kept:
        return
    config = meta.get("config")
    if config is None and (directory / CONFIG_NAME).is_file():
        config = (directory / CONFIG_NAME).read_text()
    write_atomic(directory / INDEX_NAME, _index_text({n: kept.get(f, f) for n, f in weight_map.items()},
                                                      {kept.get(f, f): c for f, c in meta.get("checksums", {}).items()},
                                                      meta.get("total_size", 0), config))


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it: readers see the old or the new."""
    tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_shard_size(tensors: dict[str, torch.Tensor], max_shard_size: int | str) -> int:
    """max_shard_size in bytes; it must hold the largest tensor (else every large tensor would get a
    shard of its own without a word, e.g. max_shard_size="1KB" writing one file per tensor)."""
    limit = parse_size(max_shard_size)
    name, t = max(tensors.items(), key=lambda kv: kv[1].numel() * kv[1].element_size())
    nbytes = t.numel() * t.element_size()
    if limit < nbytes:
        raise ValueError(f"max_shard_size = {max_shard_size!r} ({limit:,} bytes) is smaller than the largest "
                         f"tensor, {name} ({nbytes:,} bytes); use at least {-(-nbytes // 10**6)}MB")
    return limit


def file_checksum(path: Path) -> str:
    """"sha256:<hex digest>" of a file's bytes, read in 16 MiB chunks (hashlib releases the GIL on them)."""
    h = hashlib.new(CHECKSUM)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return f"{CHECKSUM}:{h.hexdigest()}"


def verify_checksum(path: Path, expected: str | None) -> None:
    """Raise ValueError naming the shard if its bytes do not hash to ``expected`` (None: nothing recorded)."""
    if expected is None:
        return
    if not expected.startswith(f"{CHECKSUM}:"):
        raise ValueError(f"{INDEX_NAME} records checksum {expected!r} for {path.name}; only {CHECKSUM!r} "
                         f"checksums are known (re-save the checkpoint with this minidsa)")
    if (actual := file_checksum(path)) != expected:
        raise ValueError(f"shard {path.name} does not match its checksum in {INDEX_NAME} ({expected} recorded, "
                         f"{actual} found): the file was damaged or changed after saving; re-save or copy it again")


def checksum_verifier(path: Path, expected: str | None) -> Callable[[], None]:
    """A function that verifies the shard's checksum the first time it is called; later calls do nothing
    once it has passed (a failure stays a failure: it is checked again on the next call)."""
    passed = False

    def verify() -> None:
        nonlocal passed
        if not passed:
            verify_checksum(path, expected)
            passed = True
    return verify


def read_index(directory: Path) -> Index:
    """The weight_map and shard checksums of ``directory``'s index, with an error naming what is wrong."""
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise ValueError(f"{directory} has no {INDEX_NAME}, so it is not a minidsa checkpoint; save one with "
                         f"model.save_pretrained(dir) or pass a preset name / config JSON path")
    try:
        index = json.loads(index_path.read_text())
        weight_map, checksums = index["weight_map"], index.get("metadata", {}).get("checksums", {})
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed {index_path}: {e}") from None
    for what, table in (("weight_map", weight_map), ("metadata.checksums", checksums)):
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise ValueError(f"malformed {index_path}: {what} must map names to strings")
    return Index(weight_map, checksums)


def open_shard(path: Path):
    """A safetensors handle (use as a context manager); unreadable headers become ValueError."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt headers
        raise ValueError(f"cannot read shard {path.name}: {e} (truncated or corrupt file?)") from None


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """The JSON header of a safetensors file and the byte length of its data section, reading only the
    first 8 + n bytes (n: the little-endian u64 length prefix) -> ({name: {"dtype", "shape",
    "data_offsets"}}, data bytes present). Raises ValueError naming the file if the header is unreadable."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path.name}: no valid safetensors header (length prefix {n}, file of {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path.name}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, size - 8 - n


def check_header(name: str, shape, dtype, expected_shape, expected_dtype: torch.dtype) -> None:
    """The stored shape and dtype (torch or safetensors spelling) of tensor ``name`` must be the expected ones."""
    if tuple(shape) != tuple(expected_shape):
        raise ValueError(f"tensor {name} has shape {tuple(shape)}, expected {tuple(expected_shape)}")
    if dtype != expected_dtype and dtype != SAFETENSORS_NAMES.get(expected_dtype):
        raise ValueError(f"tensor {name} has dtype {dtype}, expected {expected_dtype}")


def store(name: str, fname: str, read: Callable[[], torch.Tensor], target: torch.Tensor, dtype: torch.dtype,
          check: Callable[[str, torch.Tensor], None]) -> None:
    """t = read(); check its shape, its dtype (the on-disk ``dtype``) and its values (``check(name, t)``
    raises ValueError naming the tensor); copy it into ``target`` (exact: ``target`` is at least as wide
    as ``dtype``)."""
    try:
        t = read()
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"cannot read tensor {name} from {fname}: {e} (truncated or corrupt file?)") from None
    check_header(name, t.shape, t.dtype, target.shape, dtype)
    check(name, t)
    with torch.no_grad():
        target.copy_(t)


def tensor_reader(path: Path, name: str, target: torch.Tensor, dtype: torch.dtype,
                  check: Callable[[str, torch.Tensor], None], verify: Callable[[], None],
                  seen: tuple | None) -> Callable[[], None]:
    """A zero-argument function that reads ``name`` from the shard at ``path`` into ``target``, checked
    as at load: the file must still be ``seen`` (its ``file_identity`` at load), then ``verify()`` (the
    shard's checksum), then header and values (the MoE layer calls it when an expert is first routed)."""
    def read() -> torch.Tensor:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def read_checked() -> None:
        if file_identity(path) != seen:
            raise CheckpointChangedError(
                f"shard {path} changed on disk after the model was loaded with lazy_experts=True (size or "
                f"modification time differ), so expert tensor {name} is not read from it; load the checkpoint "
                f"again", path)
        verify()
        store(name, path.name, read, target, dtype, check)
    return read_checked


class CheckpointChangedError(OSError):
    """A shard read lazily is no longer the file verified at load."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(errno.ESTALE, message, str(path))


def file_identity(path: Path) -> tuple[int, int, int] | None:
    """(size, modification time, inode) of ``path``: a file replaced or rewritten changes at least one."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino
