"""The engine on rank 0, the other ranks following it step by step.

Requests reach rank 0 only (a server, a script). ``lead(engine)`` gives rank 0's engine a listener that
sends every call that changes what it will run, a queued request (with its seed fixed, so every rank
samples alike), an abort, a step, to the other ranks (a step before it runs); ``follow(engine)`` makes
another rank's engine run those calls in the same order until ``stop``. The scheduler is deterministic and every rank's logits are
the same bits (parallel.py), so every rank schedules, preempts and samples exactly as rank 0 does, and
only these small commands cross between processes (``broadcast_object_list``, among the job's own ranks).
A rank that dies makes the others' next command or step raise ``PeerLostError`` naming it (failures.py).
"""

from __future__ import annotations

import torch.distributed as dist

from ..serving import Engine
from .failures import naming_lost_peers


def _send(command: tuple) -> None:
    with naming_lost_peers(f"sending {command[0]!r} to the other ranks"):
        dist.broadcast_object_list([command], src=0)


class Leader:
    """Rank 0's engine listener (``Engine.add_listener``): each queued request (its seed as drawn, so every rank
    samples alike), abort and step goes to the followers, the step before it runs."""

    def queued(self, prompt, ids, features, params, request_id) -> None:
        _send(("enqueue", prompt, list(ids), [f.cpu() for f in features], params, request_id))

    def aborted(self, request_id) -> None:
        _send(("abort", request_id))

    def stepping(self) -> None:
        _send(("step",))


def lead(engine: Engine) -> Engine:
    """Rank 0: mirror ``enqueue``, ``abort`` and ``step`` to the followers (returns the same engine)."""
    engine.add_listener(Leader())
    return engine


def stop() -> None:
    """Rank 0: release the followers (their ``follow`` returns)."""
    _send(("stop",))


def follow(engine: Engine) -> int:
    """Any rank but 0: run rank 0's engine calls on this rank's engine until it stops; the steps run."""
    steps = 0
    while True:
        box = [None]
        with naming_lost_peers("waiting for rank 0's next command"):
            dist.broadcast_object_list(box, src=0)
        kind, *args = box[0]
        if kind == "stop":
            return steps
        if kind == "enqueue":
            prompt, ids, features, params, rid = args
            engine.enqueue(prompt, ids, [f.to(engine.model.device) for f in features], params, rid)
        elif kind == "abort":
            engine.abort(*args)
        else:
            engine.step()
            steps += 1
