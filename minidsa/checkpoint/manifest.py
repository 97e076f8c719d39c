"""What a config implies on disk: the shipped checkpoints by name, the manifest of every tensor a checkpoint
holds (name, shape, on-disk dtype) and the parameter counts, all built on the meta device so they work at
reference scale (docs/design.md §0, §9). The validator checks a directory against this manifest.
"""

from __future__ import annotations

from pathlib import Path

from ..config import ModelConfig, load_config, preset_names
from ..formats.dtypes import SAFETENSORS_NAMES, disk_dtype
from ..model.experts import expert_shapes
from ..model.minidsa import MiniDSA

DEFAULT_MODEL = "default"  # the trained checkpoint shipped in the package (PRETRAINED below)
# Checkpoints shipped inside the package, by the name load() accepts for them. "default" is the tiny
# config trained on the synthetic tasks (training/tasks.py) by the README's training command.
PRETRAINED = {"default": Path(__file__).resolve().parent.parent / "pretrained" / "default"}


def pretrained_dir(name: str) -> Path:
    """The directory of a checkpoint shipped in the package, by its name in PRETRAINED."""
    if not PRETRAINED[name].is_dir():
        raise ValueError(f"the shipped checkpoint {name!r} is missing from this install "
                         f"({PRETRAINED[name]}); reinstall minidsa or pass a checkpoint directory")
    return PRETRAINED[name]


def resolve_config(name_or_config) -> ModelConfig:
    """``load_config`` plus the names of the shipped checkpoints: ``"default"`` is the config the shipped
    model was trained with (its config.json), so every entry point that takes a config name takes the
    names ``load`` takes. The config layer knows presets only; shipped checkpoints live up here."""
    if isinstance(name_or_config, str) and name_or_config in PRETRAINED:
        return load_config(pretrained_dir(name_or_config) / "config.json")
    if isinstance(name_or_config, (str, Path)) and str(name_or_config).strip() and not Path(name_or_config).exists():
        check_known_name(str(name_or_config))
    return load_config(name_or_config)


def looks_like_path(text: str) -> bool:
    """Whether a name that matches no file was meant as a path (a directory or a JSON file), not a preset."""
    return text.endswith(".json") or "/" in text or "\\" in text or text.startswith(("~", "."))


def check_known_name(text: str) -> None:
    """Raise for ``text`` that names no file: FileNotFoundError for a path, ValueError for a name that is
    neither a shipped checkpoint nor a preset. Each says what was passed and what would be accepted, where
    the config layer alone could only say that no config file is there."""
    accepted = (f"an existing checkpoint directory (save_pretrained's output), a config JSON path, "
                f"{' or '.join(map(repr, PRETRAINED))} (the shipped model) or a preset name ({', '.join(preset_names())})")
    if looks_like_path(text):
        what = "config file" if text.endswith(".json") else "checkpoint directory"
        raise FileNotFoundError(f"{what} {text!r} does not exist; pass {accepted}")
    if text not in preset_names():
        raise ValueError(f"unknown config name {text!r}: no directory of that name, not a shipped checkpoint and "
                         f"not a preset; pass {accepted}")


def checkpoint_manifest(name_or_config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor ``save_pretrained`` writes for a config: {name: (shape, on-disk dtype)}, the dtype in
    safetensors spelling ("BF16", "F32", "U8"). Built on the meta device, so it works for "k3.1-pro"."""
    cfg = resolve_config(name_or_config)
    model = MiniDSA(cfg, device="meta", init=False)
    return {name: (tuple(t.shape), SAFETENSORS_NAMES[disk_dtype(name, t, cfg.torch_dtype)])
            for name, t in model.checkpoint_tensors().items()}


def count_parameters(name_or_config) -> dict[str, int]:
    """Parameters of any config, built on the meta device (no memory); docs/design.md §0.

    total: every weight, a packed MXFP4 expert element counted once (its scales are not parameters).
    active: what one token's decoder computation touches, i.e. all but the routed experts it is not
    routed to, leaving out the input embedding (a row lookup) and the vision tower and projector (the
    model card's definition). active_with_embedding_and_vision: the same plus those.
    """
    cfg = resolve_config(name_or_config)
    model = MiniDSA(cfg, device="meta", init=False)
    moe = model.moe_layers()
    total = sum(p.numel() for p in model.parameters()) + sum(m.experts.packed.numel() * 2 for m in moe)
    per_expert = sum(rows * k for rows, k in expert_shapes(cfg).values())
    active_all = total - len(moe) * (cfg.moe.num_experts - cfg.moe.top_k) * per_expert
    outside = [model.language_model.model.embed_tokens, model.vision_tower, model.mm_projector]
    left_out = sum(p.numel() for module in outside for p in module.parameters())
    return {"total": total, "active": active_all - left_out, "active_with_embedding_and_vision": active_all}
