"""Tensor and expert parallelism over torch.distributed (docs/design.md §20).

plan.py: which rank holds which slice of every checkpoint tensor, and each rank's bytes;
parallel.py: one rank's model (its slices, its all-reduces);
launch.py: sharded loading, gloo workers spawned from Python, torchrun;
follow.py: the engine on rank 0, the other ranks following its calls;
failures.py: a rank that cannot load, or dies, named in one error by every rank.
"""

from .failures import PeerLostError, RankLoadError
from .follow import follow, lead, stop
from .launch import generate, load_rank, logits, spawn
from .parallel import Comm, local_config, shard_from_model, shard_model
from .plan import Parallelism, rank_bytes, shard_manifest, tensor_slice

__all__ = ["Comm", "Parallelism", "PeerLostError", "RankLoadError", "follow", "generate", "lead", "load_rank",
           "local_config", "logits", "rank_bytes", "shard_from_model", "shard_manifest", "shard_model", "spawn", "stop",
           "tensor_slice"]
