"""Small messages between the job's ranks as JSON and plain tensors: nothing is unpickled.

torch.distributed's object collectives (``broadcast_object_list``, ``all_gather_object``) pickle on one rank
and unpickle on the others, so a peer that is not who it should be (a port another process reached first)
could run code in every rank that listens. The job's messages are small and plain (ids, strings, numbers,
sampling parameters, image features), so they cross as UTF-8 JSON in a uint8 tensor, tensors as tensors
whose dtype and shape the JSON names. The process group is gloo (launch.py), so every tensor here is on
the CPU.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

_DTYPES = {str(t): t for t in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                               torch.int32, torch.uint8)}


def _encode(value) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _decode(data: torch.Tensor):
    return json.loads(bytes(data.tolist()).decode())


def broadcast_json(value=None, src: int = 0, group=None):
    """``value`` (JSON-encodable, given on rank ``src``) on every rank of ``group``."""
    mine = dist.get_rank() == src
    data = _encode(value) if mine else None
    size = torch.tensor([data.numel() if mine else 0], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    if not mine:
        data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src, group=group)
    return value if mine else _decode(data)


def all_gather_json(value, world: int, group=None) -> list:
    """Every rank's ``value`` (JSON-encodable), in rank order, on every rank of ``group`` (``world`` ranks)."""
    data = _encode(value)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [_decode(g[: int(s)]) for g, s in zip(gathered, sizes)]


def tensor_specs(tensors: list[torch.Tensor]) -> list[list]:
    """[dtype name, shape] of each tensor: what ``broadcast_tensors`` needs on the receiving ranks."""
    for t in tensors:
        if str(t.dtype) not in _DTYPES:
            raise TypeError(f"a {t.dtype} tensor cannot cross ranks here; use one of {sorted(_DTYPES)}")
    return [[str(t.dtype), list(t.shape)] for t in tensors]


def broadcast_tensors(tensors: list[torch.Tensor] | None, specs: list[list], src: int = 0) -> list[torch.Tensor]:
    """``tensors`` (on rank ``src``; None elsewhere) on every rank, CPU, as ``specs`` (``tensor_specs``) describe."""
    mine = dist.get_rank() == src
    out = []
    for i, (dtype, shape) in enumerate(specs):
        t = tensors[i].detach().cpu().contiguous() if mine else torch.empty(shape, dtype=_DTYPES[dtype])
        # bf16 crosses as its bytes (gloo sends no bfloat16 tensor)
        dist.broadcast(t.view(torch.uint8) if t.dtype == torch.bfloat16 and t.dim() else t, src)
        out.append(t)
    return out
