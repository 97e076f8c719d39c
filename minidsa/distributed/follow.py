"""The engine on rank 0, the other ranks following it step by step.

Requests reach rank 0 only (a server, a script). ``lead(engine)`` gives rank 0's engine a listener that
sends every call that changes what it will run, a queued request (with its seed fixed, so every rank
samples alike), an abort, a step, to the other ranks (a step before it runs); ``follow(engine)`` makes
another rank's engine run those calls in the same order until ``stop``. The scheduler is deterministic and every rank's logits are
the same bits (parallel.py), so every rank schedules, preempts and samples exactly as rank 0 does, and
only these small commands cross between processes, as JSON and tensors (messages.py: nothing is unpickled).
A rank that dies makes the others' next command or step raise ``PeerLostError`` naming it (failures.py).
"""

from __future__ import annotations

import dataclasses

from ..serving import Engine, SamplingParams
from .failures import naming_lost_peers
from .messages import broadcast_json, broadcast_tensors, tensor_specs


def _send(command: dict, tensors=()) -> None:
    """``command`` (JSON) and then ``tensors`` (the specs of which it carries) to every other rank."""
    tensors = list(tensors)
    specs = tensor_specs(tensors)
    with naming_lost_peers(f"sending {command['kind']!r} to the other ranks"):
        broadcast_json(command | {"tensors": specs})
        broadcast_tensors(tensors, specs)


class Leader:
    """Rank 0's engine listener (``Engine.add_listener``): each queued request (its seed as drawn, so every rank
    samples alike), abort and step goes to the followers, the step before it runs."""

    def queued(self, prompt, ids, features, params, request_id) -> None:
        _send({"kind": "enqueue", "prompt": prompt, "ids": [int(i) for i in ids], "request_id": request_id,
               "params": dataclasses.asdict(params)}, features)

    def aborted(self, request_id) -> None:
        _send({"kind": "abort", "request_id": request_id})

    def stepping(self) -> None:
        _send({"kind": "step"})


def lead(engine: Engine) -> Engine:
    """Rank 0: mirror ``enqueue``, ``abort`` and ``step`` to the followers (returns the same engine)."""
    engine.add_listener(Leader())
    return engine


def stop() -> None:
    """Rank 0: release the followers (their ``follow`` returns)."""
    _send({"kind": "stop"})


def follow(engine: Engine) -> int:
    """Any rank but 0: run rank 0's engine calls on this rank's engine until it stops; the steps run."""
    steps = 0
    while True:
        with naming_lost_peers("waiting for rank 0's next command"):
            command = broadcast_json()
            features = broadcast_tensors(None, command["tensors"])
        kind = command["kind"]
        if kind == "stop":
            return steps
        if kind == "enqueue":
            p = command["params"]
            params = SamplingParams(**(p | {"stop": None if p["stop"] is None else tuple(p["stop"])}))
            engine.enqueue(command["prompt"], command["ids"], [f.to(engine.model.device) for f in features], params,
                           command["request_id"])
        elif kind == "abort":
            engine.abort(command["request_id"])
        else:
            engine.step()
            steps += 1
