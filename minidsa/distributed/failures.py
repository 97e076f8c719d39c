"""One rank's failure, told by every rank in one line that names it.

A rank fails in one of two ways:
- **at load** (a shard that does not match its checksum, a NaN in its slice, a missing tensor). Loading runs
  no collective, so a rank that fails there could leave the others waiting in the first all-reduce of a
  forward, or worse, running it on a half-loaded model. ``agree_on_load`` is the one collective after
  loading: every rank sends its error text (or None), and every rank raises the same ``RankLoadError``
  naming the failed rank(s) and each reason.
- **later, by dying** (killed, out of memory, its own error) **or hanging**: its peers learn of it as a
  gloo error in their next collective ("Connection reset by peer", "Connection closed by peer", a timeout),
  which names an address, not a rank. ``lost(error, during)`` makes that a ``PeerLostError`` naming the
  rank: ``note_peers`` exchanged every rank's host and process id when the job started, and a peer on this
  host whose process is gone (or a zombie) is the one lost. A peer on another host, or one alive but
  stuck, cannot be told apart that way, and the message says so.

Both errors name their rank(s) already, so launchers pass them on without a prefix of their own;
``RankLoadError`` is a ValueError and ``PeerLostError`` a ConnectionError (an OSError), so the CLI prints
either as one ``error:`` line and exits 2.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time

import torch.distributed as dist

from .messages import all_gather_json

# How long a survivor looks for the process that closed its connection before naming none: a peer's
# sockets close a moment before the kernel reports the process gone, and a cascade of survivors exiting
# takes a moment to reach every rank.
FIND_DEAD_PEER_S = 2.0

# gloo's words for a peer gone (its sockets closed by the kernel) or silent past the process group's timeout;
# any other RuntimeError of a collective (mismatched sizes: a bug) is left as it is
PEER_FAILURE = re.compile(r"connection (?:reset|closed|refused)|broken pipe|timed out|timeout|socket closed", re.I)
MAX_REASONS = 3  # distinct load errors spelt out in full; the ranks of any others are listed
_job: dict = {}  # this process's rank and [(host, pid)] of every rank, from note_peers


class RankError(Exception):
    """An error whose message already names the rank(s) it is about: pass it on as it is."""


class RankLoadError(RankError, ValueError):
    """One or more ranks could not load their part of the model; every rank raises the same message."""


class PeerLostError(RankError, ConnectionError):
    """A collective failed because a peer rank died or stopped answering; the message names it when it can."""


def note_peers(rank: int, world: int) -> None:
    """Collective, once per job after the process group is up: learn every rank's host and process id, so
    that ``lost`` can tell which peer's process is gone."""
    with naming_lost_peers("exchanging process ids at start"):
        procs = [tuple(p) for p in all_gather_json([socket.gethostname(), os.getpid()], world)]
    _job.update(rank=rank, procs=procs)


@contextlib.contextmanager
def naming_lost_peers(during: str):
    """Around collectives: gloo's error for a peer that died or stopped answering becomes ``lost(e, during)``."""
    try:
        yield
    except RuntimeError as e:
        if not PEER_FAILURE.search(str(e)):
            raise
        raise lost(e, during) from e


def _gone(host: str, pid: int) -> bool:
    """Whether the process ``pid`` on ``host`` has ended (False when it cannot be told: another host)."""
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)  # signal 0: a check, nothing is sent
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, under another user
        return False
    try:  # killed but not yet reaped by its parent: a zombie, as dead as a process gets
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):  # no /proc (macOS): alive as far as this host can tell
        return False


def _gloo_reason(error: BaseException) -> str:
    """gloo's message without its source path, its first sentence only: 'Read error [addr]:port: Connection
    reset by peer'."""
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", " ".join(str(error).split()))
    return text.split(". ", 1)[0]


def lost(error: BaseException, during: str) -> PeerLostError:
    """The ``PeerLostError`` for a collective that failed with ``error`` (gloo's RuntimeError) while this rank
    was ``during`` (e.g. "in a tensor-parallel all-reduce"), naming the peer rank(s) whose process ended."""
    rank = _job.get("rank", dist.get_rank() if dist.is_initialized() else 0)
    procs = _job.get("procs")
    world = len(procs) if procs else (dist.get_world_size() if dist.is_initialized() else 1)
    gone: list[int] = []
    deadline = time.monotonic() + FIND_DEAD_PEER_S
    while procs:
        gone = [r for r, (host, pid) in enumerate(procs) if r != rank and _gone(host, pid)]
        if gone or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if gone:
        pids = ", ".join(str(procs[r][1]) for r in gone)
        who = (f"rank {gone[0]} of {world} (pid {pids})" if len(gone) == 1
               else f"ranks {', '.join(map(str, gone))} of {world} (pids {pids})")
        return PeerLostError(f"{who} exited while rank {rank} was {during}; every rank stops (the lost rank's own "
                             f"output, or torchrun's summary, says why it ended)")
    reason = _gloo_reason(error)
    if world == 2:
        return PeerLostError(f"rank {1 - rank} of 2 stopped answering while rank {rank} was {during} ({reason}); "
                             f"every rank stops (rank {1 - rank}'s own output says why)")
    return PeerLostError(f"a peer of rank {rank} (of {world}) stopped answering while rank {rank} was {during} "
                         f"({reason}); it runs on another host or is stuck, so this rank cannot tell which: every "
                         f"rank stops (the other ranks' output, or torchrun's summary, names it)")


def _reason(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if isinstance(error, (ValueError, TypeError, OSError)) else f"{type(error).__name__}: {text}"


def agree_on_load(rank: int, world: int, label: str, failure: BaseException | None, group=None) -> None:
    """Collective over ``group`` (every rank of the job), right after each rank loaded its part: raise the
    same ``RankLoadError`` on every rank when any rank's load failed (``failure``: this rank's exception,
    or None), naming the failed ranks and each reason. ``label``: how the job is split, e.g. "(tp=2, ep=1)"."""
    mine = None if failure is None else _reason(failure)
    reasons = {rank: mine}  # without a process group (one process loading one rank's part): its own only
    if world > 1 and dist.is_initialized():
        try:
            with naming_lost_peers("waiting for the other ranks to finish loading"):
                gathered = all_gather_json(mine, world, group=group)
            reasons = dict(enumerate(gathered))
        except PeerLostError:
            if failure is None:
                raise
            # this rank's own load error is the one to report; the lost peer is the next thing to look at
    by_reason: dict[str, list[int]] = {}
    for r, text in reasons.items():
        if text is not None:
            by_reason.setdefault(text, []).append(r)
    if not by_reason:
        return
    parts = []
    for i, (text, ranks) in enumerate(list(by_reason.items())[:MAX_REASONS]):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who}{f' of {world} {label}' if i == 0 else ''} failed: {text}")
    if rest := sorted(r for ranks in list(by_reason.values())[MAX_REASONS:] for r in ranks):
        parts.append(f"ranks {', '.join(map(str, rest))} failed too, for other reasons")
    raise RankLoadError("; ".join(parts)) from failure
