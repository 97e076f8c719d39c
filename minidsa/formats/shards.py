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

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
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
# The temporary file safetensors writes beside its target and renames to it when complete (the name Rust's
# tempfile crate gives: ".tmp" and six letters or digits); a kill during the write leaves it behind.
SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")
SECOND_NAME = re.compile(re.escape(KEPT_PREFIX) + SHARD_NAME.pattern)  # an old shard's second name
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

    0. leftovers of interrupted saves (``is_temporary`` files, second names the index does not list) are
       removed, so that their space is free before anything is written;
    1. the old checkpoint's shards of the names new shards take get a second name, ``.previous-`` and the
       name (a hard link, or a copy), and the old index is rewritten to point at those and to embed the old
       config: the old checkpoint stays whole, config.json or not, while its usual names are overwritten;
    2. the new shards are written under temporary names, given the mode open() gives a new file here
       (``new_file_mode``; safetensors creates its files 0600), and renamed into place;
    3. config.json is removed and the new index is renamed over the old one: the commit. The loader refuses
       a config.json that differs from the index's config (``config.load_config``), so no moment may leave
       the old config.json beside the new index; a directory holding the index alone loads from it;
    4. config.json is written; old shards (``model-NNNNN-of-MMMMM.safetensors`` the new index does not
       list), their second names and every temporary file of this save or an earlier one (ours and
       safetensors') are removed.

    A save that fails with an exception removes its temporary files before it raises; one killed leaves them
    for the next save's step 0.

    Files of other names (a user's notes, evaluation.json) are never touched. One save at a time per
    directory: two processes saving into one directory at once remove each other's files.
    """
    groups = _shard_groups(tensors, check_shard_size(tensors, max_shard_size))
    remove_leftovers(directory)
    try:
        old_config = _keep_old_checkpoint(directory)
        weight_map, checksums = {}, {}
        for i, group in enumerate(groups, start=1):
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            checksums[fname] = _write_shard(group, directory, fname)
            weight_map.update({name: fname for name in group})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (directory / CONFIG_NAME).unlink(missing_ok=True)  # the old index embeds the old config (step 1)
        try:
            write_atomic(directory / INDEX_NAME, _index_text(weight_map, checksums, total, config_text))
        except BaseException:  # not committed: the old checkpoint stays, and gets its config.json back
            if old_config is not None:
                with contextlib.suppress(OSError):
                    write_atomic(directory / CONFIG_NAME, old_config)
            raise
        write_atomic(directory / CONFIG_NAME, config_text)
    except BaseException:
        with contextlib.suppress(OSError):
            remove_leftovers(directory)
        raise
    _remove_unlisted(directory, set(checksums))


def _remove_unlisted(directory: Path, listed: set[str]) -> None:
    """Remove what the new index does not list: old shards, their second names, temporaries."""
    for path in directory.iterdir():
        if path.name not in listed and (SHARD_NAME.fullmatch(path.name) or SECOND_NAME.fullmatch(path.name)
                                        or is_temporary(path)):
            path.unlink()


def _shard_groups(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """``tensors`` in order, cut into groups of at most ``limit`` bytes (a larger tensor alone), on the CPU."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append({})
            size = 0
        groups[-1][name] = t.detach().cpu().contiguous()
        size += nbytes
    return groups


def _write_shard(group: dict[str, torch.Tensor], directory: Path, fname: str) -> str:
    """Write one shard under its temporary name, give it the directory's new-file mode, rename it into
    place -> its checksum."""
    tmp = directory / f".{fname}{TMP_SUFFIX}"
    mode = new_file_mode(tmp)
    try:
        save_file(group, str(tmp), metadata={"format": "pt"})
    except SafetensorError as e:  # safetensors reports a failed write in its own type: make it an OSError
        raise OSError(errno.EIO, f"cannot write shard {fname} ({e})", str(tmp)) from None
    set_mode(tmp, mode)
    checksum = file_checksum(tmp)  # re-read from the page cache: about 1 s per GB
    os.replace(tmp, directory / fname)
    return checksum


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is a regular file that only a save can have made and only an interrupted one leaves:
    ``.NAME.partial`` for NAME a shard name, the index or config.json (``write_shards``, ``write_atomic``), or
    safetensors' own temporary file, ``.tmp`` and six letters or digits (in its target's directory, renamed
    to the target when complete), empty or beginning as a safetensors file or as a sized file not yet written
    (zeros). A user's file of another name or content never matches."""
    try:
        if not stat.S_ISREG(path.lstat().st_mode):  # never a directory, never through a link
            return False
    except OSError:
        return False
    name = path.name
    if name.startswith(".") and name.endswith(TMP_SUFFIX):
        inner = name[1:-len(TMP_SUFFIX)]
        return bool(SHARD_NAME.fullmatch(inner)) or inner in (INDEX_NAME, CONFIG_NAME)
    if not SAFETENSORS_TMP.fullmatch(name):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    # safetensors creates the file, sizes it (zeros), then writes the header's length, the header's JSON and
    # the data: a kill leaves it empty, zeros at the start, or the start of a header.
    if not head.strip(b"\0"):
        return True
    n = int.from_bytes(head[:8], "little") if len(head) == 9 else 0
    return 0 < n <= MAX_HEADER_BYTES and head[8:] == b"{"


def remove_leftovers(directory: Path) -> None:
    """Remove what interrupted saves left in ``directory``: every ``is_temporary`` file, and the second names
    of old shards (``.previous-model-NNNNN-of-MMMMM.safetensors``) that the current index does not list.
    While the index is unreadable the second names stay (they may be all that is left of a checkpoint)."""
    try:
        listed = set(json.loads((directory / INDEX_NAME).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        listed = None
    for path in directory.iterdir():
        kept_name = bool(SECOND_NAME.fullmatch(path.name)) and listed is not None and path.name not in listed
        with contextlib.suppress(OSError):  # what cannot be removed now is tried again by the next save
            if is_temporary(path) or kept_name and stat.S_ISREG(path.lstat().st_mode):
                path.unlink(missing_ok=True)


def new_file_mode(path: Path) -> int:
    """Create ``path`` empty (a file of that name is removed first) as open() creates any file, and return its
    permission bits: 0o666 less the process umask, or what a default ACL of the directory gives. safetensors
    writes through a temporary file of its own, created 0o600, and renames it to its target, so its files
    would be unreadable to other users whatever the umask: writers chmod them to this mode, the mode of the
    config.json and index beside them."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def set_mode(path: Path, mode: int) -> None:
    """chmod ``path`` to ``mode`` (``new_file_mode``'s). A file system without Unix modes (FAT, some network
    mounts) may refuse: its files have no modes to get wrong, and the file was just created by this process,
    so a refusal cannot mean another owner."""
    with contextlib.suppress(OSError):
        os.chmod(path, mode)


def _index_text(weight_map: dict, checksums: dict, total: int, config_text: str | None) -> str:
    meta = {"total_size": total, "checksums": checksums}
    if config_text is not None:
        meta["config"] = config_text
    return json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2) + "\n"


def _keep_old_checkpoint(directory: Path) -> str | None:
    """Step 1 of write_shards: give the old shards a second name and point the old index at it, embedding
    the old config (config.json's, where the index has none: older minidsa wrote it there only), so that
    config.json may be removed before the commit. Returns the old config text, or None."""
    try:
        old = json.loads((directory / INDEX_NAME).read_text())
        weight_map, meta = dict(old["weight_map"]), dict(old.get("metadata", {}))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # no readable checkpoint here: nothing to keep
    kept = {}
    for fname in sorted(set(weight_map.values())):
        if not SHARD_NAME.fullmatch(fname) or not (directory / fname).is_file():
            continue  # a second name already, or a name no new shard takes: nothing overwrites it
        kept[fname] = KEPT_PREFIX + fname
        (directory / kept[fname]).unlink(missing_ok=True)
        try:
            os.link(directory / fname, directory / kept[fname])
        except OSError:  # a file system without hard links
            shutil.copyfile(directory / fname, directory / kept[fname])
    config = meta.get("config")
    if config is None:
        with contextlib.suppress(OSError, UnicodeDecodeError):  # none readable: the old checkpoint had no config
            config = (directory / CONFIG_NAME).read_text()
    if kept or config != meta.get("config"):
        write_atomic(directory / INDEX_NAME, _index_text({n: kept.get(f, f) for n, f in weight_map.items()},
                                                          {kept.get(f, f): c for f, c in meta.get("checksums", {}).items()},
                                                          meta.get("total_size", 0), config))
    return config if isinstance(config, str) else None


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
