"""Running one model over several processes: sharded loading, gloo workers spawned from Python, torchrun.

``load_rank(source, par, rank, comm)``: this rank's model. From a checkpoint directory each rank opens the
shards it needs and reads only its slices (safetensors slicing), verified as the single-process load verifies
whole tensors: each shard it opens is hashed whole against the index's checksum first, each tensor's stored
dtype and full shape are checked against the config's manifest, and each slice's values (floats finite, E8M0
scales neither NaN nor absurd). From a preset name every rank builds the same seeded model and keeps its
slices. Loading ends in one collective (failures.py): a rank that failed makes every rank raise the same
error naming it, before any forward.

``spawn(task, tp, ep, *args)`` starts ``max(tp, ep)`` processes (torch.multiprocessing, gloo over a file
store in a temporary directory), runs ``task(rank, par, comm, *args)`` in each and returns rank 0's result;
a rank that raises or dies stops every rank, and the error names the rank. ``logits`` and ``generate`` are
such tasks, for notebooks and tests; ``engine_task`` runs an Engine on rank 0 with the other ranks following
it (follow.py). Under ``torchrun`` (``python -m minidsa generate ... --tp T --ep E``) the processes exist
already: ``init_from_env`` joins the process group they share. Every rank runs the same steps on the same
batch; rank 0 prints.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..checkpoint.loading import build_model, check_values
from ..checkpoint.manifest import PRETRAINED, checkpoint_manifest, pretrained_dir
from ..config import load_config
from ..formats import shards
from ..serving import Engine
from ..serving.generation import generate as run_generate
from .failures import RankError, agree_on_load, note_peers
from .follow import follow, lead, stop
from .parallel import Comm, shard_from_model, shard_model
from .plan import Parallelism

# How long a rank waits in one collective of a step for a peer that is alive but silent (stuck, or gone
# another way) before it fails naming the wait. A peer that died is seen at once: its sockets close.
STEP_TIMEOUT = datetime.timedelta(minutes=5)
# How long the ranks that finished loading wait for the slowest one. Every rank hashes each shard file it
# reads from, whole: at K3.1's scale (tp=8, ep=64, 2 GB shards) 770-930 GB a rank, 10-14 minutes at
# 1.1-1.3 GB/s, and ranks read different shards.
LOAD_TIMEOUT = datetime.timedelta(hours=1)


def load_rank(source, par: Parallelism, rank: int, comm: Comm):
    """Rank ``rank``'s model of a checkpoint directory (its slices only) or of a preset name / config.

    Collective when a process group is up: every rank of the job calls it, and it ends by comparing the
    ranks' outcomes, so that a rank that could not load (a shard failing its checksum, a NaN in its slice,
    a missing tensor) makes every rank raise the same ``RankLoadError`` (a ValueError) naming that rank and
    its reason, before any forward's all-reduce could wait on it or run on a half-loaded job."""
    group = None
    if dist.is_available() and dist.is_initialized() and par.world > 1:
        group = dist.new_group(timeout=LOAD_TIMEOUT)  # the whole job, with time for the slowest rank's load
    try:
        model, failure = _load(source, par, rank, comm), None
    except Exception as e:  # noqa: BLE001 -- told to every rank below, then raised here with its cause
        model, failure = None, e
    try:
        agree_on_load(rank, par.world, _label(par), failure, group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    return model


def _load(source, par: Parallelism, rank: int, comm: Comm):
    if isinstance(source, str) and source in PRETRAINED:
        source = pretrained_dir(source)
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        return _load_slices(Path(source), par, rank, comm)
    return shard_from_model(build_model(source), par, rank, comm)


def _load_slices(directory: Path, par: Parallelism, rank: int, comm: Comm):
    cfg = load_config(directory)
    manifest = checkpoint_manifest(cfg)  # {name: (full shape, on-disk dtype)}
    weight_map, checksums = shards.read_index(directory)
    handles: dict[str, object] = {}

    def open_verified(fname: str, name: str):
        # A slice cannot be checked against a whole-file checksum, so the rank hashes each shard it opens,
        # whole, before using any of it: as the single-process load does, one streaming pass per shard.
        if not (directory / fname).is_file():
            raise ValueError(f"shard {fname} listed in {shards.INDEX_NAME} for tensor {name} is missing from "
                             f"{directory}")
        try:
            shards.verify_checksum(directory / fname, checksums.get(fname))
        except ValueError as e:
            raise ValueError(f"{e} (opened to read tensor {name})") from None
        return shards.open_shard(directory / fname).__enter__()

    def read(name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        if name not in weight_map:
            raise ValueError(f"checkpoint {directory} has no tensor {name}")
        fname = weight_map[name]
        if fname not in handles:
            handles[fname] = open_verified(fname, name)
        part = handles[fname].get_slice(name)
        shards.check_header(name, part.get_shape(), part.get_dtype(), *manifest[name])
        try:
            t = part[slices]
        except Exception as e:  # safetensors' own errors for a truncated data section
            raise ValueError(f"cannot read {name} from {fname}: {e} (truncated or corrupt file?)") from None
        try:  # this rank's slice only: another rank's rows are that rank's to check
            check_values(name, t)
        except ValueError as e:
            where = ", ".join(f"{s.start}:{s.stop}" for s in slices)
            raise ValueError(f"{e}; found in its slice [{where}], read from shard {fname}") from None
        return t

    shapes = {name: shape for name, (shape, _) in manifest.items()}
    try:
        return shard_model(read, shapes, cfg, par, rank, comm)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


# ---------------------------------------------------------------- processes
def _worker(rank: int, par: Parallelism, store: str, task, args, results) -> None:
    torch.set_num_threads(1)  # N processes on a few cores: one thread each, or they oversubscribe
    dist.init_process_group("gloo", store=dist.FileStore(store, par.world), rank=rank, world_size=par.world,
                            timeout=STEP_TIMEOUT)
    try:
        note_peers(rank, par.world)
        out = task(rank, par, Comm(par, rank), *args)
        if rank == 0:  # as numpy: a shared-memory tensor would outlive the process that shares it
            results.put(_map_tensors(out, lambda t: t.detach().cpu().numpy()))
    except Exception as e:
        # a RankError names its rank(s) already (a failed load, a peer that died), the same on every rank
        message = str(e) if isinstance(e, RankError) else f"rank {rank} of {par.world} {_label(par)} failed: {e}"
        # when written: a peer's failure follows the first one. Written aside and renamed, so the parent never
        # reads a half-written file from a rank that is stopped mid-write (it is, once another rank fails).
        with open(f"{store}.writing-error.{rank}", "w") as f:
            f.write(f"{time.time()!r}\t{message}")
        os.replace(f"{store}.writing-error.{rank}", f"{store}.error.{rank}")
        raise RuntimeError(message) from e
    finally:
        dist.destroy_process_group()


def _label(par: Parallelism) -> str:
    return f"(tp={par.tp}, ep={par.ep})"


def spawn(task, tp: int = 1, ep: int = 1, *args):
    """Run ``task(rank, par, comm, *args)`` (a module-level function) on max(tp, ep) gloo processes; rank 0's
    return value. RuntimeError naming the rank when any rank raises or dies (the others are stopped)."""
    par = Parallelism(tp, ep)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_worker, args=(par, os.path.join(tmp, "store"), task, args, results),
                               nprocs=par.world, join=True, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            # The first rank to fail is the cause; the others failed after it (a peer's closed connection).
            errors = sorted(Path(tmp).glob("store.error.*"), key=lambda p: float(p.read_text().split("\t", 1)[0]))
            if errors:
                raise RuntimeError(errors[0].read_text().split("\t", 1)[1]) from None
            if isinstance(e, mp.ProcessExitedException):  # killed, or exited without a Python exception
                how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
                raise RuntimeError(f"rank {e.error_index} of {par.world} {_label(par)} died ({how}); the other "
                                   f"ranks were stopped") from None
            raise RuntimeError(str(e)) from None
    return _map_tensors(results.get(), torch.from_numpy, numpy=True)


def _map_tensors(x, fn, numpy: bool = False):
    """x with every tensor (numpy array with ``numpy``) in nested dicts, lists and tuples replaced by fn(it)."""
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn, numpy) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn, numpy) for v in x)
    return fn(x) if (type(x).__name__ == "ndarray" if numpy else isinstance(x, torch.Tensor)) else x


def init_from_env(tp: int, ep: int) -> tuple[Parallelism, int, Comm]:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment;
    set by hand, the same works without torchrun): (par, rank, comm). A collective in a step waits at most
    ``STEP_TIMEOUT`` for a silent peer; a rank that dies makes the others raise ``PeerLostError`` naming it."""
    par = Parallelism(tp, ep)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != par.world:
        raise ValueError(f"--tp {tp} --ep {ep} needs {par.world} processes, torchrun started {world}; use "
                         f"torchrun --nproc-per-node {par.world}")
    if not dist.is_initialized():
        try:
            dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl", timeout=STEP_TIMEOUT)
        except dist.DistError as e:  # a rank that never came, an address in use: one line, not gloo's trace
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise ConnectionError(f"rank {os.environ.get('RANK')} of {world} could not join the job's process "
                                  f"group at {where} ({' '.join(str(e).split())[:300]}); start all {world} "
                                  f"ranks together, e.g. torchrun --nproc-per-node {world}") from None
    rank = dist.get_rank()
    note_peers(rank, par.world)
    return par, rank, Comm(par, rank)


# ---------------------------------------------------------------- tasks
def logits_task(rank, par, comm, source, input_ids, decode_ids, images):
    """Logits of a plain forward over input_ids [B, T], then a cached prefill of the same ids and one
    decode step per column of decode_ids [B, n]: {"forward", "prefill", "decode": [B, n, vocab]}."""
    model = load_rank(source, par, rank, comm)
    out = {}
    with torch.inference_mode():
        kw = dict(input_ids=input_ids)
        if images:  # the images' tokens first: one <|media_pad|> per feature row
            feats = model.encode_images(model.prepare_images(images))
            pads = torch.full((1, sum(f.shape[0] for f in feats)), model.tokenizer.media_pad_id)
            kw = dict(inputs_embeds=model.embed(torch.cat([pads, input_ids], dim=1), feats))
        out["forward"] = model(**kw)
        cache = model.new_cache()
        sids = [cache.add_sequence() for _ in range(input_ids.shape[0])]
        out["prefill"] = model(**kw, cache=cache, seq_ids=sids)
        out["decode"] = torch.cat([model(decode_ids[:, i:i + 1], cache=cache, seq_ids=sids)
                                   for i in range(decode_ids.shape[1])], dim=1)
    out["resident_bytes"] = sum(t.numel() * t.element_size() for t in model.checkpoint_tensors().values())
    return out


def generate_task(rank, par, comm, source, prompt, kwargs):
    """The text ``minidsa.generate`` returns, every rank stepping together (same tokens on every rank)."""
    return run_generate(prompt, model=load_rank(source, par, rank, comm), **kwargs)


def engine_task(rank, par, comm, source, prompts, params):
    """Rank 0's engine serves ``prompts``; the other ranks follow it (follow.py): rank 0's output texts."""
    engine = Engine(load_rank(source, par, rank, comm))
    if rank != 0:
        follow(engine)
        return None
    lead(engine)
    try:
        return [out.text for out in engine.generate(prompts, params, progress=False)]
    finally:
        stop()


def logits(source, input_ids: torch.Tensor, decode_ids: torch.Tensor, *, tp: int = 1, ep: int = 1,
           images: list | None = None) -> dict:
    """``logits_task`` on max(tp, ep) spawned gloo processes: rank 0's logits and resident bytes."""
    return spawn(logits_task, tp, ep, source, input_ids, decode_ids, images)


def generate(source, prompt: str, *, tp: int = 1, ep: int = 1, **kwargs) -> str:
    """``minidsa.generate(prompt, ...)`` of ``source`` split over max(tp, ep) spawned gloo processes."""
    return spawn(generate_task, tp, ep, source, prompt, kwargs)
