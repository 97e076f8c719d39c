"""The whole model: embeddings (text and images) -> decoder (decoder.py) -> lm_head, with or without a
paged KV cache; also its initialisation, dtypes, expert workspace and backend.

``model(input_ids)`` with no cache is the plain reference: one full forward over fixed tokens.
``model(input_ids, cache=..., seq_ids=...)`` appends the tokens to cached sequences; it runs the
prefill path for several new tokens per sequence and the decode path for one, and must give the
same logits as the reference over the whole sequence.

Parameter names follow the real checkpoint (docs/design.md §9): ``language_model.model.layers.{i}.
self_attn.*``, ``language_model.lm_head.weight`` and so on.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import nn

from .. import ops
from ..cache import CacheContext, CacheLayout, PagedKVCache, check_cache_layout
from ..config import ModelConfig, load_config
from ..formats import shards
from ..formats.dtypes import disk_dtype, memory_dtype
from ..ops._checks import on_host
from ..tokenizer import ByteTokenizer
from .decoder import LanguageModel
from .experts import ExpertWorkspace, expert_stats
from .fused import fuse_all
from .initialization import init_weights
from .moe import LatentMoE
from .trace import ForwardTrace
from .vision import MultimodalProjector, PreparedImage, VisionTower, preprocess

_CREATE_LOCK = threading.Lock()  # guards the lazy creation of a model's workspace and default cache

_EXPERT_BUFFERS = (".experts.packed", ".experts.scales")  # stacked; the checkpoint names them per expert


class MiniDSA(nn.Module):
    """The whole model. ``forward(input_ids [B, T]) -> logits [B, T, vocab]`` (fp32; fp64 for a float64 model)."""

    def __init__(self, config: ModelConfig | str, *, device: torch.device | str = "cpu", init: bool = True) -> None:
        """Build the model; ``init=False`` leaves weights uninitialised (a checkpoint fills them)."""
        super().__init__()
        cfg = load_config(config)
        self.config = cfg
        self.tokenizer = ByteTokenizer()
        if cfg.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"vocab_size = {cfg.vocab_size} is smaller than the tokenizer's "
                             f"{self.tokenizer.vocab_size} ids; raise it")
        with torch.device(device):  # build in place: the reference-scale config only fits on "meta"
            self.language_model = LanguageModel(cfg, self.expert_workspace)
            self.vision_tower = VisionTower(cfg)
            self.mm_projector = MultimodalProjector(cfg)
        self.backend: str | None = None  # op backend of every forward; None = whatever is in force
        self._default_cache: PagedKVCache | None = None
        self._workspace: ExpertWorkspace | None = None
        if str(device) != "meta" and init:
            init_weights(self, self.config)
        for name, p in self.named_parameters():  # an fp32 copy of a BF16-on-disk weight holds bf16 values, so
            stored = disk_dtype(name, p, cfg.torch_dtype)  # save -> load is exact (docs/design.md §9)
            p.data = p.data.to(stored).to(memory_dtype(name, cfg.torch_dtype))
        fuse_all(self)  # where the weights now lie, for good: no forward may move one (model/fused.py)
        if cfg.moe.offline_experts and init and str(device) != "meta":
            self.set_expert_mode("offline")

    def _apply(self, fn, recurse=True):  # to, to_empty, half...: new storage, stacked now, not in a forward
        out = super()._apply(fn, recurse)
        fuse_all(self)  # a CUDA graph captured before the first forward must see the final addresses
        return out

    @property
    def device(self) -> torch.device:
        return self.language_model.lm_head.weight.device

    def set_backend(self, backend: str | None) -> "MiniDSA":
        """Op backend of every forward: "torch", "triton", "gluon", "auto", or None (whatever ops.use_backend says)."""
        self.backend = None if backend is None else ops._dispatch.check_backend(backend)
        return self

    # ---------------------------------------------------------------- experts
    def expert_workspace(self) -> ExpertWorkspace:
        """The one FP8 workspace shared by every MoE layer (allocated on first use)."""
        return self._workspace or self._create_once("_workspace", lambda: ExpertWorkspace(self.config, self.device))

    def _create_once(self, attr: str, make):
        """``self.<attr>``, made on first use under a lock: two threads' first calls must not make two."""
        with _CREATE_LOCK:
            if getattr(self, attr) is None:
                setattr(self, attr, make())
            return getattr(self, attr)

    def moe_layers(self) -> list[LatentMoE]:
        return [layer.block_sparse_moe for layer in self.language_model.model.layers if layer.is_moe]

    def materialize_experts(self) -> None:
        """Read every routed expert still on disk (a model loaded with lazy_experts=True)."""
        for moe in self.moe_layers():
            moe.experts.materialize()

    def set_expert_mode(self, mode: str) -> "MiniDSA":
        """"online": convert routed experts per forward into the shared workspace; "offline": convert
        every expert once now and keep the FP8 copies (memory grows with depth)."""
        if mode not in ("online", "offline"):
            raise ValueError(f"expert mode {mode!r}; use 'online' or 'offline'")
        for moe in self.moe_layers():
            moe.experts.convert_all() if mode == "offline" else setattr(moe.experts, "offline", None)
        return self

    def expert_stats(self) -> dict[str, int]:
        """Expert, workspace and offline bytes; routed experts converted since the reset and in the last forward."""
        return expert_stats([m.experts for m in self.moe_layers()], self._workspace)

    def reset_expert_stats(self) -> None:
        self._workspace is None or self._workspace.routed.zero_()

    # ---------------------------------------------------------------- cache
    def cache_layout(self, num_blocks: int | None = None) -> CacheLayout:
        cfg, dtype = self.config, self.language_model.lm_head.weight.dtype
        n = cfg.kv_num_blocks if num_blocks is None else num_blocks
        return self.language_model.model.cache_layout(n, cfg.kv_block_size, cfg.max_sequences, dtype)

    def new_cache(self, num_blocks: int | None = None) -> PagedKVCache:
        """A fresh paged cache for this model (``num_blocks`` defaults to config.kv_num_blocks)."""
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"num_blocks = {num_blocks!r} must be a positive int")
        return PagedKVCache(self.cache_layout(num_blocks), self.device)

    def default_cache(self) -> PagedKVCache:
        """The cache generate() uses when none is passed; created once, shared by calls."""
        return self._default_cache or self._create_once("_default_cache", self.new_cache)

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None,
                cache: PagedKVCache | None = None, seq_ids: list[int] | None = None,
                trace: ForwardTrace | None = None) -> torch.Tensor:
        """input_ids int [B, T] (or inputs_embeds [B, T, d], e.g. from ``embed``) -> logits fp32 [B, T, vocab].

        Without ``cache``: positions 0..T-1, nothing stored. With ``cache`` and ``seq_ids`` (one cache
        sequence per row): the tokens continue those sequences; the cache (KV and KDA state) changes
        only if the whole forward succeeds. ``trace`` (a ForwardTrace) receives the DSA selections
        and the AttnRes depth weights.
        """
        h = self._input_embeddings(input_ids, inputs_embeds)
        if trace is not None and not isinstance(trace, ForwardTrace):
            raise TypeError(f"trace must be a minidsa.ForwardTrace, got {type(trace).__name__}")
        ctx = self._cache_context(cache, seq_ids, *h.shape[:2], h.device)
        if self._workspace is not None:
            self._workspace.routed[1].zero_()  # this forward's conversion count
        try:
            with ops.use_backend(self.backend):
                logits = self.language_model.lm_head(self.language_model.model(h, ctx, trace))
        except BaseException:
            ctx is None or ctx.rollback()  # the blocks this forward reserved go back; nothing was committed
            raise
        if ctx is not None:
            ctx.publish()  # success: the staged KDA states and the new lengths become the cache's
        return logits if logits.dtype == torch.float64 else logits.float()

    def _input_embeddings(self, input_ids, inputs_embeds) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            self._check_ids(input_ids)
            return self.language_model.model.embed_tokens(input_ids.long())
        if (not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3
                or inputs_embeds.shape[1] < 1 or inputs_embeds.shape[2] != self.config.hidden_size):
            raise ValueError(f"inputs_embeds must be [B, T, {self.config.hidden_size}] with T >= 1, got "
                             f"{tuple(getattr(inputs_embeds, 'shape', ()))}")
        return inputs_embeds

    def _check_ids(self, input_ids) -> None:
        """Shape and dtype always; the id range when the ids are in CPU memory (no device sync)."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids [B, T], got {type(input_ids).__name__}")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must have shape [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        lo, hi = (int(input_ids.min()), int(input_ids.max())) if on_host(input_ids) else (0, 0)
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"input_ids hold {lo if lo < 0 else hi}, outside [0, {self.config.vocab_size})")

    def _cache_context(self, cache, seq_ids, B: int, T: int, device) -> CacheContext | None:
        if cache is None:
            if seq_ids is not None:
                raise ValueError("seq_ids was given without a cache; pass cache= too")
            if T > self.config.max_seq_len:
                raise ValueError(f"input has {T} tokens, more than the model's context max_seq_len = "
                                 f"{self.config.max_seq_len}; shorten it")
            return None
        self.check_cache(cache)
        return cache.prepare(seq_ids, T, device, max_len=self.config.max_seq_len, rows=B)

    def check_cache(self, cache) -> None:
        """TypeError / ValueError unless ``cache`` is a PagedKVCache made for this model's layout."""
        check_cache_layout(cache, self.cache_layout)

    # ---------------------------------------------------------------- images
    def prepare_images(self, images: list) -> list[PreparedImage]:
        """Load and preprocess images (arrays, tensors or PNG/JPEG paths); errors name the image."""
        return [preprocess(im, self.config, name=f"images[{i}]") for i, im in enumerate(images)]

    def encode_images(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """Vision tower + projector: one [num_tokens_i, hidden] tensor per image."""
        if not images:
            return []
        feats = self.vision_tower([PreparedImage(im.patches.to(self.device), im.grid, im.frames) for im in images])
        return [self.mm_projector(f) for f in feats]

    def embed(self, input_ids: torch.Tensor, image_features: list[torch.Tensor] = ()) -> torch.Tensor:
        """Token embeddings [B, T, d] with the ``<|media_pad|>`` positions filled, in order, by the rows of
        ``image_features`` (their total count must equal the number of such positions)."""
        self._check_ids(input_ids)
        h = self.language_model.model.embed_tokens(input_ids.long())
        slots = input_ids == self.tokenizer.media_pad_id
        n = int(slots.sum())
        feats = torch.cat(list(image_features)) if len(image_features) else h.new_zeros(0, h.shape[-1])
        if feats.shape[0] != n:
            raise ValueError(f"input_ids hold {n} <|media_pad|> positions but the images give {feats.shape[0]} "
                             f"feature rows; expand each placeholder to its image's token count")
        h = h.clone()
        h[slots] = feats.to(h.dtype)
        return h

    # ---------------------------------------------------------------- checkpoint
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint by its real name (stacked expert buffers split per expert; views)."""
        out = {name: t for name, t in self.state_dict().items() if not name.endswith(_EXPERT_BUFFERS)}
        for i, layer in enumerate(self.language_model.model.layers):
            if layer.is_moe:
                prefix = f"language_model.model.layers.{i}.block_sparse_moe.experts."
                out.update({prefix + name: t for name, t in layer.block_sparse_moe.experts.checkpoint_tensors().items()})
        return out

    def save_pretrained(self, directory, max_shard_size: int | str = "2GB") -> Path:
        """config.json + model-0000N-of-0000M.safetensors shards + model.safetensors.index.json (with each
        shard's checksum), real names. Shards an earlier save left in ``directory`` are removed. Saving over a
        checkpoint is safe to interrupt: the directory then loads as the old checkpoint or the new one."""
        self.materialize_experts()  # a lazily loaded model reads its remaining experts first
        dtype = self.config.torch_dtype  # each tensor in its on-disk dtype (router and norms: the model's)
        tensors = {n: t.to(disk_dtype(n, t, dtype)) for n, t in self.checkpoint_tensors().items()}
        shards.check_shard_size(tensors, max_shard_size)  # a bad size creates no directory
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        shards.write_shards(tensors, directory, max_shard_size, self.config.to_json_text())
        return directory
