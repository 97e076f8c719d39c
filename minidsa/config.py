"""Model configuration: one dataclass per component, loaded from JSON by name or path.

A config is the single source of every size in the model. The JSON files in ``scaled_configs/``
are the user-facing presets; ``load_config("tiny")`` finds them inside the installed package, and
``load_config("path/to/x.json")`` reads any file. Validation names the bad field (dotted path,
e.g. ``mla.kv_lora_rank``) and the allowed range, so a typo never becomes a silent shape bug.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

LAYER_TYPES = ("mla", "kda")  # "mla" = Gated MLA + DSA indexer; "kda" = Kimi Delta Attention


@dataclass
class MLAConfig:
    """Gated Multi-head Latent Attention (docs/design.md §2)."""

    num_heads: int = 4  # attention heads; all heads share one DSA top-k set
    q_lora_rank: int = 32  # width of the compressed query c_q (the indexer reads it too)
    kv_lora_rank: int = 16  # width of the cached latent c_kv: what decode reads per token
    qk_nope_head_dim: int = 16  # per-head query/key width decompressed from the latents
    qk_rope_head_dim: int = 8  # width of the decoupled key part k_pe shared by all heads (NoPE here)
    v_head_dim: int = 16  # per-head value width; also the width of each output-gate slice


@dataclass
class IndexerConfig:
    """DSA lightning indexer (docs/design.md §2)."""

    num_heads: int = 2  # indexer heads; their ReLU scores are summed with learned signed weights
    head_dim: int = 16  # D_I: width of q_I and of the single cached k_I per token
    topk: int = 8  # keys each query attends to; smaller than the context so sparsity is real
    fp8: bool = False  # deployment numerics: q_I/k_I in float8_e4m3fn with power-of-two scales
    hadamard: bool = False  # rotate both q_I and k_I by a Walsh-Hadamard matrix before fp8 (needs 2^n head_dim)


@dataclass
class KDAConfig:
    """Kimi Delta Attention (docs/design.md §5); filled in by the KDA layers."""

    num_heads: int = 4  # heads of the recurrent state
    head_dim: int = 16  # K = V per head; the state is [K, V] fp32 per head
    conv_size: int = 4  # causal depthwise short-conv kernel on q, k, v
    decay_lower_bound: float = -5.0  # log-decay floor: alpha in (e^lb, 1)
    decay_rank: int = 16  # low-rank width of the decay projection (W_fa d->rank, W_fb rank->H*K)
    chunk_size: int = 64  # prefill chunk length of the WY/UT chunked form
    a_log_size: int = 128  # length of the A_log tensor: the release pads its num_heads entries with zeros to 128


@dataclass
class MoEConfig:
    """Latent mixture of experts (docs/design.md §6); layers >= first_dense_layers use it."""

    num_experts: int = 8  # routed experts; more than top_k so routing is real
    top_k: int = 2  # experts per token
    latent_size: int = 32  # routed experts work in this latent width (hidden -> latent -> hidden)
    expert_intermediate_size: int = 32  # SiTU-GLU width inside each routed expert
    shared_intermediate_size: int = 96  # width of the fused shared experts (dense SiTU-GLU on full width)
    routed_scaling_factor: float = 1.0  # multiplies the renormalised routing weights
    first_dense_layers: int = 1  # layers [0, n) use the dense FFN instead of MoE
    workspace_experts: int = 8  # experts the shared FP8 workspace holds at once; larger routed sets go in rounds
    offline_experts: bool = False  # convert every expert to FP8 at load (memory grows with depth) instead of online


@dataclass
class VisionConfig:
    """MoonViT-V2-style vision tower (docs/design.md §8)."""

    patch_size: int = 14  # pixels per patch side
    hidden_size: int = 64  # tower width
    num_layers: int = 2  # tower depth
    num_heads: int = 4  # tower attention heads
    head_dim: int = 16  # per-head width (MoonViT-V2: 12 x 128 on a 1024-wide tower, so not hidden/heads)
    intermediate_size: int = 128  # tower MLP width
    merge_size: int = 2  # merge x merge neighbouring patches into one text token
    projector_hidden_size: int = 256  # hidden width of the Linear-GELU-Linear projector
    max_patches: int = 1024  # patch budget per image; larger images are scaled down
    position_grid: int = 16  # side of the learned position grid, resized bilinearly to each image's grid


@dataclass
class ModelConfig:
    """The whole decoder. Defaults describe a tiny model; presets live in scaled_configs/."""

    name: str = "custom"  # label shown in logs and plots
    vocab_size: int = 264  # byte tokenizer needs 263 ids; padded for alignment
    hidden_size: int = 64  # residual width d
    layer_types: list[str] = field(default_factory=lambda: ["mla"] * 4)  # explicit pattern; must end in "mla"
    dense_intermediate_size: int = 128  # SiTU-GLU width of the dense FFN of layers < moe.first_dense_layers
    activation_beta_gate: float = 4.0  # SiTU-GLU gate saturation: |gate act| < beta_gate
    activation_beta_up: float = 25.0  # SiTU-GLU up saturation: |up| < beta_up
    rms_norm_eps: float = 1e-5  # eps of every RMSNorm
    attn_res_block_size: int = 2  # Block AttnRes: layers per stored block (embedding is block 0)
    attn_res_two_phase: bool = False  # exact inference schedule: score a block's mixers in one batch, then merge
    max_seq_len: int = 128  # context length: the longest prompt + generation a sequence may hold
    kv_block_size: int = 8  # tokens per paged-KV block; smaller than max_seq_len so paging is real
    kv_num_blocks: int = 64  # blocks in a default cache (shared by all sequences of a batch)
    max_sequences: int = 16  # live sequences per cache: each owns a preallocated KDA state slot
    init_std: float = 0.02  # std of the random initial weights
    seed: int = 0  # seed of the random initial weights, so "tiny" is the same model everywhere
    dtype: str = "float32"  # parameter dtype: float32 (reference numerics) or bfloat16
    mla: MLAConfig = field(default_factory=MLAConfig)
    indexer: IndexerConfig = field(default_factory=IndexerConfig)
    kda: KDAConfig = field(default_factory=KDAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)

    # ---------------------------------------------------------------- derived
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mla"]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[self.dtype]

    # ---------------------------------------------------------------- io
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json_text())

    def to_json_text(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a config must be a JSON object, got {type(data).__name__}")
        cfg = _build(cls, data, prefix="")
        cfg.validate()
        return cfg

    def replace(self, **changes) -> "ModelConfig":
        """A validated copy with top-level fields changed (nested sections: pass a whole dataclass)."""
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it may be."""
        _positive(self, "", ["vocab_size", "hidden_size", "dense_intermediate_size",
                             "attn_res_block_size", "max_seq_len", "kv_block_size", "kv_num_blocks",
                             "max_sequences"])
        _positive_float(self, "", ["rms_norm_eps", "init_std", "activation_beta_gate", "activation_beta_up"])
        if not isinstance(self.layer_types, list) or not self.layer_types:
            raise ValueError(f"layer_types must be a non-empty list of {LAYER_TYPES}, got {self.layer_types!r}")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}] = {t!r} is not a known layer type; use one of {LAYER_TYPES}")
        if self.layer_types[-1] != "mla":
            raise ValueError(
                f"layer_types must end with an 'mla' layer (the model's pattern has a trailing MLA+DSA layer), "
                f"got {self.layer_types[-1]!r} last")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"dtype = {self.dtype!r}; use 'float32', 'bfloat16' or 'float64'")
        if self.kv_block_size > self.max_seq_len:
            raise ValueError(f"kv_block_size = {self.kv_block_size} must be <= max_seq_len = {self.max_seq_len}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self._validate_sections()

    def _validate_sections(self) -> None:
        _positive(self.mla, "mla.", ["num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                     "qk_rope_head_dim", "v_head_dim"])
        _positive(self.indexer, "indexer.", ["num_heads", "head_dim", "topk"])
        if self.indexer.hadamard and self.indexer.head_dim & (self.indexer.head_dim - 1):
            raise ValueError(f"indexer.head_dim = {self.indexer.head_dim} must be a power of two when "
                             f"indexer.hadamard is true (Walsh-Hadamard size)")
        if self.indexer.hadamard and not self.indexer.fp8:
            raise ValueError("indexer.hadamard = true needs indexer.fp8 = true (the rotation exists to spread "
                             "outliers before fp8 quantisation)")
        _positive(self.kda, "kda.", ["num_heads", "head_dim", "conv_size", "decay_rank", "chunk_size", "a_log_size"])
        if self.kda.a_log_size < self.kda.num_heads:
            raise ValueError(f"kda.a_log_size = {self.kda.a_log_size} must be >= kda.num_heads = {self.kda.num_heads} "
                             f"(A_log holds one entry per head, padded with zeros)")
        if not self.kda.decay_lower_bound < 0:
            raise ValueError(f"kda.decay_lower_bound = {self.kda.decay_lower_bound} must be < 0")
        _positive(self.moe, "moe.", ["num_experts", "top_k", "latent_size", "expert_intermediate_size",
                                     "shared_intermediate_size", "workspace_experts"])
        for f in ("latent_size", "expert_intermediate_size"):
            if getattr(self.moe, f) % 32:
                raise ValueError(f"config field moe.{f} = {getattr(self.moe, f)} must be a multiple of 32 "
                                 f"(MXFP4 scales cover 32 elements along each expert matrix's input dim)")
        if self.moe.workspace_experts > self.moe.num_experts:
            raise ValueError(f"moe.workspace_experts = {self.moe.workspace_experts} must be <= moe.num_experts = "
                             f"{self.moe.num_experts} (a layer never routes to more experts than it has)")
        if self.moe.top_k > self.moe.num_experts:
            raise ValueError(f"moe.top_k = {self.moe.top_k} must be <= moe.num_experts = {self.moe.num_experts}")
        if not 0 <= self.moe.first_dense_layers <= self.num_layers:
            raise ValueError(f"moe.first_dense_layers = {self.moe.first_dense_layers} must be in "
                             f"[0, {self.num_layers}]")
        _positive(self.vision, "vision.", ["patch_size", "hidden_size", "num_layers", "num_heads", "head_dim",
                                           "intermediate_size", "merge_size", "projector_hidden_size",
                                           "max_patches", "position_grid"])
        if self.vision.head_dim % 4:
            raise ValueError(f"vision.head_dim = {self.vision.head_dim} must be a multiple of 4 (2-D RoPE turns "
                             f"channel pairs alternately by patch column and row, at hd/4 frequencies)")
        if self.vision.max_patches < self.vision.merge_size ** 2:
            raise ValueError(f"vision.max_patches = {self.vision.max_patches} must hold at least one "
                             f"{self.vision.merge_size} x {self.vision.merge_size} group of patches")


def _build(cls, data: dict, prefix: str):
    """Build a (nested) dataclass from a dict, rejecting unknown keys and wrong types by name."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ValueError(f"unknown config field {prefix}{key!r}; known fields: {sorted(fields)}")
        f = fields[key]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ValueError(f"config field {prefix}{key} must be an object, got {value!r}")
            kwargs[key] = _build(type(default), value, prefix=f"{prefix}{key}.")
            continue
        kwargs[key] = _check_type(f"{prefix}{key}", value, default)
    return cls(**kwargs)


def _check_type(name: str, value, default):
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"config field {name} must be true or false, got {value!r}")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config field {name} must be an integer, got {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"config field {name} must be a finite number, got {value!r}")
        value = float(value)
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise ValueError(f"config field {name} must be a string, got {value!r}")
    elif isinstance(default, list):
        if not isinstance(value, list):
            raise ValueError(f"config field {name} must be a list, got {value!r}")
    return value


def _positive(obj, prefix: str, names: list[str]) -> None:
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"config field {prefix}{n} = {v!r} must be a positive integer (>= 1)")


def _positive_float(obj, prefix: str, names: list[str]) -> None:
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
            raise ValueError(f"config field {prefix}{n} = {v!r} must be a positive finite number")


# -------------------------------------------------------------------- presets
def preset_names() -> list[str]:
    """Names of the JSON presets shipped in scaled_configs/ (e.g. 'tiny', 'laptop')."""
    return sorted(p.name[:-5] for p in _preset_dir().iterdir() if p.name.endswith(".json"))


def _preset_dir():
    # Installed (wheel or editable): the package minidsa.scaled_configs maps to scaled_configs/.
    try:
        d = resources.files("minidsa.scaled_configs")
        if d.is_dir():
            return d
    except (ModuleNotFoundError, TypeError):
        pass
    # Source tree without installation (e.g. PYTHONPATH=.): the folder beside the package.
    return Path(__file__).resolve().parent.parent / "scaled_configs"


def load_config(name_or_path: "str | Path | ModelConfig | dict") -> ModelConfig:
    """Load a config by preset name ("tiny"), JSON file path, dict, or pass a ModelConfig through.

    A directory is accepted too if it is a saved checkpoint: its config is the one embedded in its index
    (``model.safetensors.index.json``, written with the shards) and the one of its ``config.json``, which
    must agree field for field (ConfigConflictError, a ValueError naming each differing field, if not).
    A directory holding only one of the two (config.json alone: older minidsa and other tools; the index
    alone: a save interrupted just after its commit) has that one.
    """
    if isinstance(name_or_path, ModelConfig):
        name_or_path.validate()
        return name_or_path
    if isinstance(name_or_path, dict):
        return ModelConfig.from_dict(name_or_path)
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"config must be a preset name, a path or a ModelConfig, got {type(name_or_path).__name__}")
    if not str(name_or_path).strip():  # Path("") is the working directory: say what was passed instead
        raise ValueError(f"config name {str(name_or_path)!r} is empty; pass a preset name ({preset_names()}), "
                         f"a config JSON path or a checkpoint directory")
    path = Path(name_or_path)
    if path.is_dir():
        embedded, on_file = checkpoint_configs(path)
        if embedded is not None and on_file is not None and (differences := config_differences(on_file, embedded)):
            raise ConfigConflictError(path, differences, embedded, on_file)
        if embedded is None and on_file is None:
            raise ValueError(f"directory {str(path)!r} holds no config.json, so it is not a saved checkpoint; pass "
                             f"a checkpoint directory, a config JSON path or a preset name ({preset_names()})")
        return embedded if embedded is not None else on_file
    if path.is_file():
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # e.g. a shard or an image: binary, so certainly no config
            raise ValueError(f"config file {str(path)!r} is not text, so not a config JSON; pass a preset name, a "
                             f"config JSON path or a checkpoint directory") from None
        source = str(path)
    else:
        s = str(name_or_path)
        if s.endswith(".json") or "/" in s or "\\" in s:
            raise ValueError(f"config file {s!r} does not exist")
        preset = _preset_dir() / f"{s}.json"
        if not preset.is_file():
            raise ValueError(f"unknown config name {s!r}; known presets: {preset_names()} "
                             f"(or pass a path to a JSON file)")
        text = preset.read_text()
        source = f"preset {s!r}"
    return _parse(text, source)


# Fields a config JSON may leave out. Each default is documented on its field: the released model's value
# (the SiTU-GLU betas, rms_norm_eps, A_log's stored length) or a size or seed that changes how a model is
# initialised or how much it can serve at once, never what saved weights compute. Any other field missing
# from a file is an error naming it: a silent default (attn_res_block_size, max_seq_len) changes the model.
OPTIONAL_FIELDS = frozenset({"name", "seed", "init_std", "kv_num_blocks", "max_sequences", "activation_beta_gate",
                             "activation_beta_up", "rms_norm_eps", "kda.a_log_size", "moe.workspace_experts",
                             "moe.offline_experts"})


def missing_fields(data: dict, cls=None, prefix: str = "") -> list[str]:
    """The dotted names of the fields of ``cls`` (ModelConfig) absent from ``data`` and not optional."""
    cls = cls or ModelConfig
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        name = prefix + f.name
        if f.name not in data:
            out += [] if name in OPTIONAL_FIELDS else [name]
        elif dataclasses.is_dataclass(default) and isinstance(data[f.name], dict):
            out += missing_fields(data[f.name], type(default), name + ".")
    return out


def _parse(text: str, source: str) -> ModelConfig:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed config JSON in {source}: {e}") from None
    if isinstance(data, dict) and (absent := missing_fields(data)):
        raise ValueError(f"{source} lacks the config field(s) {', '.join(absent)}; every field that changes the "
                         f"model must be given (only {', '.join(sorted(OPTIONAL_FIELDS))} have defaults)")
    try:
        return ModelConfig.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"  # formats/shards.py writes it; its metadata.config is a config too


class ConfigConflictError(ValueError):
    """A checkpoint directory whose config.json and index-embedded config differ: loading either would be a
    guess, and a wrong guess loads without complaint whenever the shapes still fit (max_seq_len, top_k).
    ``differences`` holds (dotted field, config.json's value, the index's value)."""

    def __init__(self, directory: Path, differences: list[tuple[str, Any, Any]], index_config: ModelConfig,
                 file_config: ModelConfig) -> None:
        self.directory, self.differences = Path(directory), differences
        self.index_config, self.file_config = index_config, file_config
        d = str(directory)
        super().__init__(
            f"checkpoint {d!r} holds two different configs: {CONFIG_FILE} and the config embedded in "
            f"{INDEX_FILE} (written with the shards) differ in {describe_differences(differences)}. Make one win "
            f"explicitly: to keep the config the shards were saved with, delete {str(Path(d) / CONFIG_FILE)!r} "
            f"(save_pretrained writes it again); to use {CONFIG_FILE}'s, pass it, minidsa.load({d!r}, "
            f"config={str(Path(d) / CONFIG_FILE)!r}), then save_pretrained to make it the checkpoint's config")


def describe_differences(differences: list[tuple[str, Any, Any]]) -> str:
    """"moe.num_experts (config.json: 16, index: 8), ..." for ConfigConflictError.differences."""
    return ", ".join(f"{name} ({CONFIG_FILE}: {a!r}, index: {b!r})" for name, a, b in differences)


def config_differences(a: ModelConfig, b: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(dotted field name, a's value, b's value) for every field where two configs differ, in field order."""
    def flat(data: dict, prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in data.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
        return out
    fa, fb = flat(a.to_dict()), flat(b.to_dict())
    return [(name, fa[name], fb[name]) for name in fa if fa[name] != fb[name]]


def checkpoint_configs(directory: Path) -> tuple[ModelConfig | None, ModelConfig | None]:
    """(the config embedded in ``directory``'s index, the config of its config.json), each None when absent.
    Either, when present but not a valid config, is a ValueError naming its file; for a bad config.json beside
    a valid embedded config the error also says how to make the embedded one win."""
    directory = Path(directory)
    text = _index_config(directory)
    embedded = _parse(text, f"the index of checkpoint {str(directory)!r}") if text is not None else None
    path = directory / CONFIG_FILE
    if not path.is_file():
        return embedded, None
    try:
        try:
            on_file_text = path.read_text()
        except UnicodeDecodeError:  # e.g. a shard or an image: binary, so certainly no config
            raise ValueError(f"config file {str(path)!r} is not text, so not a config JSON") from None
        on_file = _parse(on_file_text, str(path))
    except ValueError as e:
        if embedded is None:
            raise
        raise ValueError(f"{e}; {INDEX_FILE} embeds a valid config (the one the shards were saved with): delete or "
                         f"fix {str(path)!r}, or pass a config explicitly, minidsa.load({str(directory)!r}, "
                         f"config=...)") from None
    return embedded, on_file


def _index_config(directory: Path) -> str | None:
    """The config text a checkpoint's index embeds, or None (minidsa's save_pretrained writes it there, with
    the shards, and in config.json; checkpoints of older minidsa and other tools have config.json only)."""
    try:
        config = json.loads((directory / INDEX_FILE).read_text())["metadata"]["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return config if isinstance(config, str) else None
