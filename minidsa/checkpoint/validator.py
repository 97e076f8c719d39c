"""Day-0 checkpoint validator: a checkpoint directory against the manifest of its config, reading only
``config.json``, ``model.safetensors.index.json`` and each shard's header, never tensor data
(docs/design.md §9). Seconds even for the 96-shard, half-million-tensor reference checkpoint.

    python -m minidsa check-checkpoint DIR [--config NAME]
    report = minidsa.check_checkpoint("ckpt")     # report.ok, report.findings; print(report)

Findings, shard by shard: tensors the config needs that are missing (from the index or from the
shard the index names), unexpected tensors, shapes and dtypes that differ from the manifest, and
shards that are missing, unreadable, truncated or whose header describes a tensor of the wrong size.
Under ``config.json``: each field where config.json differs from the config embedded in the index (the
loader refuses such a checkpoint until one of the two wins explicitly).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..config import CONFIG_FILE, ModelConfig, checkpoint_configs, config_differences, preset_names
from ..formats import shards
from .manifest import PRETRAINED, checkpoint_manifest, pretrained_dir, resolve_config

INDEX_SHARD = "(index)"  # where findings about names the index does not list are filed
MAX_PRINTED = 20  # findings printed per shard; the rest are counted
CONFLICT_FIX = (f"{CONFIG_FILE} and the config in {shards.INDEX_NAME} differ, and minidsa.load refuses the "
                f"checkpoint until one wins: delete {{directory}}/{CONFIG_FILE} to keep the config the shards were "
                f"saved with (save_pretrained writes it again), or load with minidsa.load('{{directory}}', "
                f"config='{{directory}}/{CONFIG_FILE}') and save_pretrained to keep {CONFIG_FILE}'s")


@dataclass(frozen=True)
class Finding:
    kind: str  # "missing", "unexpected", "shape", "dtype", "shard" (the file itself) or "config"
    shard: str  # shard file it concerns, INDEX_SHARD, or CONFIG_FILE for a "config" finding
    name: str  # tensor name, or the config field of a "config" finding ("" for a whole-file problem)
    detail: str  # what is there and what was expected


@dataclass
class CheckReport:
    directory: Path
    config: str  # name of the config checked against
    tensors: int  # tensors in the manifest
    shards: int  # shard files the index lists
    seconds: float
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def __str__(self) -> str:
        lines = [f"checkpoint {self.directory} against config {self.config!r}: {self.tensors:,} tensors expected, "
                 f"{self.shards} shards read in {self.seconds:.1f} s"]
        by_shard: dict[str, list[Finding]] = {}
        for f in sorted(self.findings, key=lambda f: (f.shard, f.kind, f.name)):
            by_shard.setdefault(f.shard, []).append(f)
        for shard, found in by_shard.items():
            lines.append(f"{shard}: {len(found)} finding{'s' * (len(found) != 1)}")
            lines += [f"  {f.kind:<10} {f.name or '-'}: {f.detail}" for f in found[:MAX_PRINTED]]
            if len(found) > MAX_PRINTED:
                lines.append(f"  ... and {len(found) - MAX_PRINTED} more")
        if any(f.kind == "config" for f in self.findings):
            lines.append(CONFLICT_FIX.format(directory=self.directory))
        lines.append("OK: no findings" if self.ok else f"{len(self.findings)} finding(s)")
        return "\n".join(lines)


def check_checkpoint(directory: str | os.PathLike, config=None, *, progress: bool = True) -> CheckReport:
    """Check ``directory`` (a checkpoint directory, or ``"default"``: the shipped one) against the manifest of
    ``config``: a preset name, ``"default"`` (the shipped model's config), a config JSON path or a
    ModelConfig; None (the default) is the directory's own config: the one its index embeds (else its
    config.json). Whatever ``config`` is, a config.json that differs from the index's config is a "config"
    finding per differing field. A directory that does not exist is a FileNotFoundError."""
    start = time.perf_counter()
    directory = checkpoint_directory(directory)
    findings, cfg = config_findings(directory, explicit=config is not None)
    cfg = resolve_config(config if config is not None else cfg if cfg is not None else directory)
    manifest = checkpoint_manifest(cfg)
    weight_map = shards.read_index(directory).weight_map
    findings += [Finding("missing", INDEX_SHARD, name, f"not listed in {shards.INDEX_NAME}")
                 for name in manifest if name not in weight_map]
    by_shard: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_shard.setdefault(fname, []).append(name)
    for fname in tqdm(sorted(by_shard), unit="shard", desc="checking", disable=not progress, leave=False):
        findings += shard_findings(directory / fname, by_shard[fname], manifest, cfg.name)
    return CheckReport(directory, cfg.name, len(manifest), len(by_shard), time.perf_counter() - start, findings)


def config_findings(directory: Path, explicit: bool) -> tuple[list[Finding], ModelConfig | None]:
    """A "config" finding per field where config.json and the index's embedded config differ, and the config
    of record to check against: the index's (the shards were saved with it), config.json's where there is no
    other, or None when the directory has neither (resolve_config then says so). A config that cannot be read
    is an error, as at load, unless the caller named one to check against (``explicit``): then a finding."""
    try:
        embedded, on_file = checkpoint_configs(directory)
    except ValueError as e:
        if not explicit:
            raise
        return [Finding("config", CONFIG_FILE, "", " ".join(str(e).split()))], None
    if embedded is None or on_file is None:
        return [], embedded if embedded is not None else on_file
    return [Finding("config", CONFIG_FILE, name, f"{ours!r} in {CONFIG_FILE}, {theirs!r} in {shards.INDEX_NAME} "
                                                f"(the config the shards were saved with)")
            for name, ours, theirs in config_differences(on_file, embedded)], embedded


def checkpoint_directory(directory: str | os.PathLike) -> Path:
    """The directory to check: a path, or the name of a shipped checkpoint ("default"). A preset name has no
    files (ValueError saying how to get some); a path that is no directory is a FileNotFoundError."""
    if isinstance(directory, str) and directory in PRETRAINED:
        return pretrained_dir(directory)
    text = str(directory)
    if not text.strip():  # Path("") would be the working directory
        raise ValueError("checkpoint directory '' is empty; pass the directory save_pretrained wrote")
    path = Path(directory)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{text!r} is a file, not a checkpoint directory; pass the directory that holds "
                         f"config.json, {shards.INDEX_NAME} and the shards")
    if not path.is_absolute() and text in preset_names():
        raise ValueError(f"{text!r} is a preset: its seeded weights are built in memory, so there are no files to "
                         f"check; save them first (minidsa.load({text!r}).save_pretrained(DIR)) and check DIR, "
                         f"or check {', '.join(map(repr, PRETRAINED))} (the shipped model)")
    raise FileNotFoundError(f"checkpoint directory {text!r} does not exist; pass the directory save_pretrained wrote "
                            f"or {', '.join(map(repr, PRETRAINED))} (the shipped model)")


def shard_findings(path: Path, names: list[str], manifest: dict, config_name: str) -> list[Finding]:
    """Findings for one shard: ``names`` are the tensors the index puts in it."""
    shard = path.name
    if not path.is_file():
        return [Finding("shard", shard, "", f"the index lists {len(names)} tensor(s) here but the file is missing")]
    try:
        header, data_bytes = shards.read_header(path)
    except (ValueError, OSError) as e:
        return [Finding("shard", shard, "", str(e))]
    found = []
    listed = set(names)
    for name in names:
        if name not in manifest:
            found.append(Finding("unexpected", shard, name, f"not a tensor of config {config_name!r}"))
        elif name not in header:
            found.append(Finding("missing", shard, name, "listed in the index but absent from this shard"))
        else:
            found += _compare(shard, name, header[name], manifest[name])
    found += [Finding("unexpected", shard, name, "in this shard but not listed here by the index")
              for name in header if name not in listed]
    ends = [e["data_offsets"][1] for e in header.values() if _offsets_ok(e)]
    if ends and max(ends) > data_bytes:
        found.append(Finding("shard", shard, "", f"truncated: the header describes {max(ends):,} data bytes, "
                                                 f"the file holds {data_bytes:,}"))
    return found


def _compare(shard: str, name: str, entry, expected: tuple[tuple[int, ...], str]) -> list[Finding]:
    """One header entry {"dtype", "shape", "data_offsets"} against its manifest (shape, dtype)."""
    shape, dtype = expected
    if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list) or not _offsets_ok(entry):
        return [Finding("shard", shard, name, f"malformed header entry {entry!r}")]
    found = []
    if tuple(entry["shape"]) != shape:
        found.append(Finding("shape", shard, name, f"{tuple(entry['shape'])} on disk, expected {shape}"))
    if entry.get("dtype") != dtype:
        found.append(Finding("dtype", shard, name, f"{entry.get('dtype')} on disk, expected {dtype}"))
    begin, end = entry["data_offsets"]
    size = math.prod(entry["shape"]) * shards.ITEM_BYTES.get(entry.get("dtype"), 0)
    if end - begin != size:
        found.append(Finding("shard", shard, name, f"data_offsets span {end - begin:,} bytes, but "
                                                   f"{entry.get('dtype')} {tuple(entry['shape'])} needs {size:,}"))
    return found


def _offsets_ok(entry) -> bool:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    return (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1])
