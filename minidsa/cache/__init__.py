"""The paged KV cache and the KDA state slots (docs/design.md §3).

- ``layout.py``: what the cache holds (planes, block size, state shapes) and the out-of-blocks error.
- ``paged.py``: the block pool, block tables and state slots, and the per-forward ``CacheContext``
  of device tensors that a cached forward reads.
"""

from .layout import CacheLayout, OutOfKVBlocksError, Plane
from .paged import CacheContext, PagedKVCache, check_cache_layout

__all__ = ["CacheContext", "CacheLayout", "OutOfKVBlocksError", "PagedKVCache", "Plane", "check_cache_layout"]
