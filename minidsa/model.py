"""The whole model: embeddings (text and images) -> decoder (decoder.py) -> lm_head, with or without a
paged KV cache; also its weights' initialisation, dtypes, expert workspace and caches.

``model(input_ids)`` with no cache is the plain reference: one full forward over fixed tokens.
``model(input_ids, cache=..., seq_ids=...)`` appends the tokens to cached sequences; it runs the
prefill path for several new tokens per sequence and the decode path for one, and must give the
same logits as the reference over the whole sequence.

Parameter names follow the real checkpoint (SPEC section 9): ``language_model.model.layers.{i}.
self_attn.*``, ``language_model.lm_head.weight`` and so on.
"""

from __future__ import annotations

import torch
from torch import nn

from . import mxfp4
from .config import ModelConfig, load_config
from .decoder import ForwardTrace, LanguageModel
from .kv_cache import CacheLayout, PagedKVCache, Plane
from .mla import CacheContext
from .moe import EXPERT_WEIGHTS, ExpertWorkspace, LatentMoE, expert_shapes
from .ops import BACKENDS, acc_dtype
from .tokenizer import ByteTokenizer
from .vision import MultimodalProjector, PreparedImage, VisionTower, preprocess

# Parameters the real model keeps in fp32 whatever the compute dtype (norms, gates, decay, indexer weights).
_FP32_SUFFIXES = ("norm.weight", "k_norm.bias", "weights_proj.weight", "res_proj.weight", "A_log", "dt_bias",
                  "conv1d.weight", "gate.weight", "e_score_correction_bias")


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
        self._default_cache: PagedKVCache | None = None
        self._workspace: ExpertWorkspace | None = None
        self._last_conversions = 0  # experts converted by the most recent forward
        if str(device) != "meta" and init:
            self._init_weights()
        self._cast(cfg.torch_dtype)
        if cfg.moe.offline_experts and init and str(device) != "meta":
            self.set_expert_mode("offline")

    # ---------------------------------------------------------------- construction
    @torch.no_grad()
    def _init_weights(self) -> None:
        """Seeded initialisation, the same model on every machine: N(0, init_std) matrices, unit norms,
        zero AttnRes pseudo-queries (a fresh model averages its sources, SPEC section 1)."""
        g = torch.Generator().manual_seed(self.config.seed)

        def uniform(shape, lo, hi):
            return torch.rand(shape, generator=g, device="cpu") * (hi - lo) + lo

        for name, p in self.named_parameters():
            if name.endswith(("bias", "res_proj.weight", "A_log")):
                p.zero_()  # A_log = 0: the decay rate multiplier exp(A_log) starts at 1
            elif name.endswith("dt_bias"):
                # Spread the initial KDA decays: g = lb * sigmoid(dt_bias) ranges from ~lb/400 (long
                # memory) to lb/2 (short) across channels.
                p.copy_(uniform(p.shape, -6.0, 0.0))
            elif name.endswith("conv1d.weight"):
                bound = p.shape[-1] ** -0.5  # PyTorch's default for a depthwise conv (fan_in = kernel)
                p.copy_(uniform(p.shape, -bound, bound))
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device="cpu") * self.config.init_std)
        for layer in self.language_model.model.layers:  # routed experts: random weights, stored in MXFP4
            if layer.is_moe:
                moe = layer.block_sparse_moe
                for name in EXPERT_WEIGHTS:
                    w = torch.randn(moe.packed[name].shape[:-1] + (moe.packed[name].shape[-1] * 2,), generator=g,
                                    device="cpu") * self.config.init_std
                    packed, scales = mxfp4.quantize(w)
                    moe.packed[name].copy_(packed)
                    moe.scale[name].copy_(scales)

    # ---------------------------------------------------------------- experts
    def expert_workspace(self) -> ExpertWorkspace:
        """The one FP8 workspace shared by every MoE layer (allocated on first use)."""
        if self._workspace is None:
            self._workspace = ExpertWorkspace(self.config, self.device)
        return self._workspace

    def moe_layers(self) -> list[LatentMoE]:
        return [layer.block_sparse_moe for layer in self.language_model.model.layers if layer.is_moe]

    def materialize_experts(self) -> None:
        """Read every routed expert still on disk (a model loaded with lazy_experts=True)."""
        for moe in self.moe_layers():
            moe.materialize()

    def set_expert_mode(self, mode: str) -> "MiniDSA":
        """"online": convert routed experts per forward into the shared workspace; "offline": convert
        every expert once now and keep the FP8 copies (memory grows with depth)."""
        if mode not in ("online", "offline"):
            raise ValueError(f"expert mode {mode!r}; use 'online' or 'offline'")
        for moe in self.moe_layers():
            if mode == "offline":
                moe.convert_all()
            else:
                moe.offline = None
        return self

    def expert_stats(self) -> dict[str, int]:
        """Bytes of packed expert storage (and of the same experts in bf16), workspace bytes, the FP8
        bytes held by offline mode, expert conversions since the last reset and in the last forward."""
        layers = self.moe_layers()
        packed = sum(t.numel() for m in layers for d in (m.packed, m.scale) for t in d.values())
        elements = sum(t.numel() * 2 for m in layers for t in m.packed.values())
        offline = sum(t.numel() * t.element_size() for m in layers if m.offline is not None
                      for pair in m.offline.values() for t in pair)
        ws = self._workspace
        return {"expert_bytes_mxfp4": packed, "expert_bytes_bf16": 2 * elements,
                "workspace_bytes": ws.nbytes if ws is not None else 0, "offline_fp8_bytes": offline,
                "conversions": ws.conversions if ws is not None else 0,
                "conversions_last_forward": self._last_conversions,
                "experts_resident": sum(int(m.resident.sum()) for m in layers)}

    def reset_expert_stats(self) -> None:
        if self._workspace is not None:
            self._workspace.conversions = 0

    def _cast(self, dtype: torch.dtype) -> None:
        for name, p in self.named_parameters():
            keep = dtype != torch.float64 and name.endswith(_FP32_SUFFIXES)
            p.data = p.data.to(torch.float32 if keep else dtype)

    def set_backend(self, backend: str) -> "MiniDSA":
        """Op backend for every layer: "torch", "triton" or "auto"."""
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; use one of {BACKENDS}")
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = backend
        return self

    @property
    def device(self) -> torch.device:
        return self.language_model.lm_head.weight.device

    # ---------------------------------------------------------------- cache
    def cache_layout(self, num_blocks: int | None = None) -> CacheLayout:
        cfg = self.config
        dt = self.language_model.lm_head.weight.dtype
        planes = [Plane("kv_latent", cfg.mla.kv_lora_rank, dt), Plane("k_pe", cfg.mla.qk_rope_head_dim, dt)]
        if cfg.indexer.fp8:
            planes += [Plane("index_key", cfg.indexer.head_dim, torch.float8_e4m3fn),
                       Plane("index_key_scale", 1, torch.float32)]
        else:
            planes.append(Plane("index_key", cfg.indexer.head_dim, dt))
        kda = [layer.self_attn for layer in self.language_model.model.layers if layer.layer_type == "kda"]
        states = tuple(kda[0].state_shapes().items()) if kda else ()
        return CacheLayout(tuple(planes), len(cfg.mla_layers), cfg.kv_block_size,
                           cfg.kv_num_blocks if num_blocks is None else num_blocks,
                           states=states, num_state_layers=len(kda), num_state_slots=cfg.max_sequences,
                           state_dtype=acc_dtype(self.language_model.lm_head.weight))

    def new_cache(self, num_blocks: int | None = None) -> PagedKVCache:
        """A fresh paged cache for this model (``num_blocks`` defaults to config.kv_num_blocks)."""
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                       or num_blocks < 1):
            raise ValueError(f"num_blocks = {num_blocks!r} must be a positive int")
        return PagedKVCache(self.cache_layout(num_blocks), self.device)

    def default_cache(self) -> PagedKVCache:
        """The cache generate() uses when none is passed; created once, shared by calls."""
        if self._default_cache is None:
            self._default_cache = self.new_cache()
        return self._default_cache

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
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            self._check_ids(input_ids)
            inputs_embeds = self.language_model.model.embed_tokens(input_ids.long())
        elif (not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3
              or inputs_embeds.shape[1] < 1 or inputs_embeds.shape[2] != self.config.hidden_size):
            raise ValueError(f"inputs_embeds must be [B, T, {self.config.hidden_size}] with T >= 1, got "
                             f"{tuple(getattr(inputs_embeds, 'shape', ()))}")
        if trace is not None and not isinstance(trace, ForwardTrace):
            raise TypeError(f"trace must be a minidsa.ForwardTrace, got {type(trace).__name__}")
        B, T = inputs_embeds.shape[:2]
        ctx = None
        if cache is None:
            if seq_ids is not None:
                raise ValueError("seq_ids was given without a cache; pass cache= too")
            if T > self.config.max_seq_len:
                raise ValueError(f"input has {T} tokens, more than the model's context max_seq_len = "
                                 f"{self.config.max_seq_len}; shorten it")
        else:
            ctx = self._cache_context(cache, seq_ids, B, T, inputs_embeds.device)
        before = self._workspace.conversions if self._workspace is not None else 0
        h = self.language_model.model(inputs_embeds, ctx, trace)
        self._last_conversions = (self._workspace.conversions if self._workspace is not None else 0) - before
        logits = self.language_model.lm_head(h)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if ctx is not None:  # success: publish the staged KDA states and the new lengths
            for (layer, name), value in ctx.staged.items():
                cache.write_state(layer, name, ctx.seq_ids, value)
            for b, sid in enumerate(ctx.seq_ids):
                cache.commit(sid, int(ctx.positions[b, -1]) + 1)
        return logits

    # ---------------------------------------------------------------- images
    def prepare_images(self, images: list) -> list[PreparedImage]:
        """Load and preprocess images (arrays, tensors or PNG/JPEG paths); errors name the image."""
        return [preprocess(im, self.config, name=f"images[{i}]") for i, im in enumerate(images)]

    def encode_images(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """Vision tower + projector: one [num_tokens_i, hidden] tensor per image."""
        if not images:
            return []
        feats = self.vision_tower([PreparedImage(im.patches.to(self.device), im.grid) for im in images])
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

    def _check_ids(self, input_ids) -> None:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids [B, T], got {type(input_ids).__name__}")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must have shape [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"input_ids hold {lo if lo < 0 else hi}, outside [0, {self.config.vocab_size})")

    def _cache_context(self, cache: PagedKVCache, seq_ids, B: int, T: int, device) -> CacheContext:
        if seq_ids is None or len(seq_ids) != B:
            raise ValueError(f"pass seq_ids with one cache sequence per batch row ({B}), got {seq_ids!r}")
        if len(set(seq_ids)) != B:
            raise ValueError(f"seq_ids must be distinct, got {seq_ids!r}")
        if cache.layout != self.cache_layout(cache.layout.num_blocks):
            raise ValueError("this cache was made for a different model layout; use model.new_cache()")
        starts = [cache.seq_len(s) for s in seq_ids]
        for sid, s in zip(seq_ids, starts):
            if s + T > self.config.max_seq_len:
                raise ValueError(f"sequence {sid} would hold {s + T} tokens, more than max_seq_len = "
                                 f"{self.config.max_seq_len}")
        cache.reserve({sid: s + T for sid, s in zip(seq_ids, starts)})  # all-or-nothing
        positions = torch.tensor(starts, device=device).unsqueeze(1) + torch.arange(T, device=device)
        S = max(starts) + T
        every = torch.arange(S, device=device)
        key_slots = torch.stack([cache.slots(sid, torch.where(every < s + T, every, -1))
                                 for sid, s in zip(seq_ids, starts)])  # [B, S]
        slots = key_slots.gather(1, positions)
        return CacheContext(cache, list(seq_ids), positions, slots, key_slots)

    # ---------------------------------------------------------------- bookkeeping
    def save_pretrained(self, directory, max_shard_size: int | str = "2GB"):
        """Sharded safetensors + index JSON + config.json with the real tensor names (see checkpoint.py)."""
        from .checkpoint import save_pretrained

        return save_pretrained(self, directory, max_shard_size)

    def num_parameters(self) -> int:
        """Weights, counting each packed MXFP4 expert element once (scales are not parameters)."""
        experts = sum(t.numel() * 2 for m in self.moe_layers() for t in m.packed.values())
        return sum(p.numel() for p in self.parameters()) + experts

    def num_active_parameters(self) -> int:
        """Weights one token touches: all but the routed experts it was not routed to."""
        m = self.config.moe
        per_expert = sum(r * k for r, k in expert_shapes(self.config).values())
        return self.num_parameters() - len(self.moe_layers()) * (m.num_experts - m.top_k) * per_expert


def build_model(name_or_config="tiny", *, device: torch.device | str = "cpu") -> MiniDSA:
    """A seeded, randomly initialised model of the named config (no trained weights ship yet)."""
    return MiniDSA(load_config(name_or_config), device=device)


def count_parameters(name_or_config) -> dict[str, int]:
    """Total and per-token active parameters of any config, built on the meta device (no memory)."""
    model = MiniDSA(load_config(name_or_config), device="meta")
    return {"total": model.num_parameters(), "active": model.num_active_parameters()}
