"""Tensor and expert parallelism over torch.distributed (docs/design.md §20).

plan.py: which rank holds which slice of every checkpoint tensor, and each rank's bytes.
"""

from .plan import Parallelism, rank_bytes, shard_manifest, tensor_slice

__all__ = ["Parallelism", "rank_bytes", "shard_manifest", "tensor_slice"]
