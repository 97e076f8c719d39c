"""Rung 1, the checkpoint: the validator (names, shapes, dtypes from the shard headers alone), then a full
verified load (every tensor's values and every shard's checksum), then, where the checkpoint records
its own evaluation, known answers.

The first two catch what is structurally wrong: a missing or damaged shard, a tensor of the wrong shape
or dtype, a config that does not describe the weights, a config.json that differs from the config the
index records for the shards (even where the shapes would still fit, as a shorter max_seq_len does).
They cannot catch two tensors of one shape exchanged by a converter (each name still holds a
well-formed tensor of the right size, and a re-recorded checksum vouches for the new bytes). Only
behaviour shows that, so a checkpoint that ships ``evaluation.json`` (as the shipped model does: the
held-out accuracies of ``python -m minidsa eval``) is evaluated again on a small held-out sample and
must come close to what it recorded.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from ..checkpoint.loading import build_model, load
from ..checkpoint.manifest import PRETRAINED, pretrained_dir
from ..checkpoint.validator import CONFLICT_FIX, check_checkpoint
from ..model.minidsa import MiniDSA
from ..training.evaluation import evaluate
from .report import Gate

KNOWN_ANSWER_SAMPLES = 32  # held-out samples per task: about a second on the tiny config
KNOWN_ANSWER_METRICS = ("retrieval_accuracy", "multimodal_accuracy")


def checkpoint_dir(source) -> Path | None:
    """The directory behind ``source`` ("default", a path), or None for a preset name built in memory."""
    if isinstance(source, str) and source in PRETRAINED:
        return pretrained_dir(source)
    return Path(source) if Path(str(source)).is_dir() else None


def check(source, device: str) -> tuple[Gate, MiniDSA | None]:
    """(the gate, the loaded model or None when the gate failed)."""
    t0 = time.perf_counter()
    directory = checkpoint_dir(source)
    gate = Gate(1, "checkpoint", "PASS", "")
    if directory is None:
        model = build_model(source, device=device)
        gate.status, gate.measured = "SKIP", (f"{source!r} is a preset: seeded random weights built in memory, "
                                              f"no files to validate (save it with save_pretrained to check one)")
        gate.seconds = time.perf_counter() - t0
        return gate, model
    try:
        report = check_checkpoint(directory, progress=False)
    except (ValueError, TypeError, OSError) as e:  # config.json itself unreadable or not a valid config
        gate.status, gate.measured = "FAIL", f"the validator cannot start: {' '.join(str(e).split())}"
        gate.look_at = f"{directory / 'config.json'} and {directory / 'model.safetensors.index.json'}"
        gate.seconds = time.perf_counter() - t0
        return gate, None
    if not report.ok:
        gate.status, gate.measured = "FAIL", f"the validator found {len(report.findings)} problem(s)"
        # config.json against the index's config first: when they differ, that is the finding to act on
        found = sorted(report.findings, key=lambda f: f.kind != "config")
        gate.details = [f"{f.kind} {f.shard} {f.name or '-'}: {f.detail}" for f in found[:8]]
        gate.look_at = (f"the findings above, in {directory}: a missing or damaged shard, or a config.json that does "
                        f"not describe these weights (python -m minidsa check-checkpoint {directory})")
        if found[0].kind == "config":
            gate.look_at = CONFLICT_FIX.format(directory=directory)
        gate.seconds = time.perf_counter() - t0
        return gate, None
    try:
        model = load(directory, device=device, progress=False)
    except (ValueError, OSError) as e:
        gate.status, gate.measured = "FAIL", f"headers pass, the verified load refuses: {' '.join(str(e).split())}"
        gate.look_at = "the tensor or shard the load names: its bytes changed after the index recorded their checksum"
        gate.seconds = time.perf_counter() - t0
        return gate, None
    gate.measured = (f"{report.tensors:,} tensors in {report.shards} shard(s): names, shapes and dtypes as the "
                     f"config's manifest; values and checksums verified by the load")
    answers = known_answers(model, directory)
    if answers is not None:
        ok, text, (tol, why) = answers
        gate.measured += f"; known answers: {text}"
        gate.tolerance, gate.why = tol, why
        if not ok:
            gate.status = "FAIL"
            gate.look_at = ("tensors exchanged or mislabelled by a conversion (same shapes, so no header shows it): "
                            "compare the shards' tensor names and values with the source checkpoint")
            model = None
    gate.seconds = time.perf_counter() - t0
    return gate, model


def recorded_evaluation(directory: Path) -> dict | None:
    """The first evaluation ``evaluation.json`` records for the shipped weights, or None."""
    path = directory / "evaluation.json"
    if not path.is_file():
        return None
    runs = json.loads(path.read_text()).get("shipped", {})
    return next((m for m in runs.values() if isinstance(m, dict) and "context_length" in m), None)


def known_answers(model: MiniDSA, directory: Path) -> tuple[bool, str, tuple[str, str]] | None:
    """(ok, what was measured, (the tolerance, its reason)) against evaluation.json; None without one."""
    recorded = recorded_evaluation(directory)
    if recorded is None or model.config.max_seq_len < recorded["context_length"]:
        return None
    n = KNOWN_ANSWER_SAMPLES
    with torch.inference_mode():
        got = evaluate(model, n=n, context=recorded["context_length"], seed=1)
    parts, ok, margins = [], True, []
    for name in KNOWN_ANSWER_METRICS:
        if name not in recorded:
            continue
        p = recorded[name]
        margin = 4 * math.sqrt(max(p * (1 - p), 1 / n) / n)  # 4 standard deviations of an n-sample accuracy
        margins.append(margin)
        ok &= got[name] >= p - margin
        parts.append(f"{name.split('_')[0]} {got[name]:.2f} (recorded {p:.2f})")
    why = (f"4 standard deviations of a {n}-sample accuracy, so a sound checkpoint fails it about once in 30,000 "
           f"runs, while exchanged tensors cost most of the accuracy")
    return ok, ", ".join(parts), (f"at most {max(margins):.2f} below the record", why)
