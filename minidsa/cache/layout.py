"""What the paged cache holds: its planes, block size and KDA state shapes (docs/design.md §3).

Each layer type states what it needs (``GatedMLA.cache_planes``, ``KimiDeltaAttention.state_shapes``)
and the decoder assembles a ``CacheLayout`` from them; ``PagedKVCache`` allocates from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class OutOfKVBlocksError(ValueError, RuntimeError):
    """The cache has too few free blocks (or KDA state slots) for a request. Nothing was allocated;
    free sequences or create a larger cache (``model.new_cache(num_blocks=...)`` / config
    ``kv_num_blocks`` and ``max_sequences``)."""


@dataclass(frozen=True)
class Plane:
    """One per-token vector stored for every token of every MLA layer."""

    name: str  # e.g. "kv_latent"
    width: int  # values per token
    dtype: torch.dtype  # storage dtype (float8_e4m3fn for the quantised indexer key)


@dataclass(frozen=True)
class CacheLayout:
    """Shape of the cache: which planes, how many layers, how the pool is cut into blocks."""

    planes: tuple[Plane, ...]
    num_layers: int  # number of MLA layers (KDA layers keep state, not KV)
    block_size: int  # tokens per KV block (not the AttnRes block: that one counts layers)
    num_blocks: int  # blocks in the pool
    states: tuple[tuple[str, tuple[int, ...]], ...] = ()  # per-sequence state tensors of one KDA layer
    num_state_layers: int = 0  # number of KDA layers
    num_state_slots: int = 16  # sequences that can be live at once (each owns one state slot)
    state_dtype: torch.dtype = torch.float32  # KDA state stays fp32 (docs/design.md §10, trap 6)

    @property
    def plane_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.planes)

    def plane(self, name: str) -> Plane:
        for p in self.planes:
            if p.name == name:
                return p
        raise KeyError(f"no cache plane named {name!r}; planes: {[p.name for p in self.planes]}")

    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all MLA layers (every plane)."""
        return self.num_layers * sum(p.width * torch.empty((), dtype=p.dtype).element_size() for p in self.planes)

    def state_bytes_per_sequence(self) -> int:
        """KDA bytes one sequence occupies across all KDA layers (recurrent + conv states), whatever its length."""
        elem = torch.empty((), dtype=self.state_dtype).element_size()
        return self.num_state_layers * sum(math.prod(shape) for _, shape in self.states) * elem
