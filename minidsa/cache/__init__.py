"""The paged KV cache and the KDA state slots (docs/design.md §3).

- ``layout.py``: what the cache holds (planes, block size, state shapes) and the out-of-blocks error.
- ``paged.py``: the block pool, block tables and state slots, and the per-forward ``CacheContext``
  of device tensors that a cached forward reads.
- ``step.py``: the ``StepContext`` of one packed engine step (pieces of several sequences on one token axis).
"""

from .layout import CacheLayout, OutOfKVBlocksError, Plane
from .paged import CacheContext, PagedKVCache, check_cache_layout
from .step import StepContext, StepShape, prepare_step

__all__ = ["CacheContext", "CacheLayout", "OutOfKVBlocksError", "PagedKVCache", "Plane", "StepContext", "StepShape",
           "check_cache_layout",
           "prepare_step"]
