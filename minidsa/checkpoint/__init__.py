"""Checkpoints on disk (docs/design.md §9).

- ``loading.py``: ``load`` (a preset, a config file or a checkpoint directory), streamed and verified
  loading, the manifest of names/shapes/dtypes a config implies, parameter counts.
- ``validator.py``: the Day-0 validator, which checks a directory against its manifest from the shard
  headers alone.
"""

from .loading import DEFAULT_MODEL, PRETRAINED, build_model, checkpoint_manifest, count_parameters, default_model, load
from .validator import CheckReport, Finding, check_checkpoint

__all__ = ["DEFAULT_MODEL", "PRETRAINED", "CheckReport", "Finding", "build_model", "check_checkpoint",
           "checkpoint_manifest", "count_parameters", "default_model", "load"]
