"""Checkpoints on disk (docs/design.md §9).

- ``manifest.py``: the shipped checkpoints by name, the manifest of names/shapes/dtypes a config
  implies, parameter counts (all on the meta device).
- ``loading.py``: ``load`` (a preset, a config file or a checkpoint directory), streamed and verified.
- ``validator.py``: the Day-0 validator, which checks a directory against its manifest from the shard
  headers alone.
"""

from .loading import build_model, default_model, load
from .manifest import DEFAULT_MODEL, PRETRAINED, checkpoint_manifest, count_parameters, resolve_config
from .validator import CheckReport, Finding, check_checkpoint

__all__ = ["DEFAULT_MODEL", "PRETRAINED", "CheckReport", "Finding", "build_model", "check_checkpoint",
           "checkpoint_manifest", "count_parameters", "default_model", "load", "resolve_config"]
