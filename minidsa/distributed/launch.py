"""Running one model over several processes: sharded loading, gloo workers spawned from Python, torchrun.

``load_rank(source, par, rank, comm)``: this rank's model. From a checkpoint directory each rank opens the
shards it needs and reads only its slices (safetensors slicing), after checking each tensor's stored dtype
and full shape against the config's manifest; shard checksums cover whole files, so they are left to
``check-checkpoint``. From a preset name every rank builds the same seeded model and keeps its slices.

``spawn(task, tp, ep, *args)`` starts ``max(tp, ep)`` processes (torch.multiprocessing, gloo over a file
store in a temporary directory), runs ``task(rank, par, comm, *args)`` in each and returns rank 0's result;
a rank that raises stops every rank, and the error names the rank. ``logits`` and ``generate`` are such
tasks, for notebooks and tests; ``engine_task`` runs an Engine on rank 0 with the other ranks following it
(follow.py). Under ``torchrun`` (``python -m minidsa generate ... --tp T --ep E``) the
processes exist already: ``init_from_env`` joins the process group they share. Every rank runs the same
steps on the same batch; rank 0 prints.
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

from ..checkpoint.loading import build_model
from ..checkpoint.manifest import PRETRAINED, checkpoint_manifest, pretrained_dir
from ..config import load_config
from ..formats import shards
from ..serving import Engine
from ..serving.generation import generate as run_generate
from .follow import follow, lead, stop
from .parallel import Comm, shard_from_model, shard_model
from .plan import Parallelism


def load_rank(source, par: Parallelism, rank: int, comm: Comm):
    """Rank ``rank``'s model of a checkpoint directory (its slices only) or of a preset name / config."""
    if isinstance(source, str) and source in PRETRAINED:
        source = pretrained_dir(source)
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        return _load_slices(Path(source), par, rank, comm)
    return shard_from_model(build_model(source), par, rank, comm)


def _load_slices(directory: Path, par: Parallelism, rank: int, comm: Comm):
    cfg = load_config(directory)
    manifest = checkpoint_manifest(cfg)  # {name: (full shape, on-disk dtype)}
    weight_map = shards.read_index(directory).weight_map
    handles: dict[str, object] = {}

    def read(name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        if name not in weight_map:
            raise ValueError(f"checkpoint {directory} has no tensor {name}")
        fname = weight_map[name]
        if fname not in handles:
            handles[fname] = shards.open_shard(directory / fname).__enter__()
        part = handles[fname].get_slice(name)
        shards.check_header(name, part.get_shape(), part.get_dtype(), *manifest[name])
        try:
            return part[slices]
        except Exception as e:  # safetensors' own errors for a truncated data section
            raise ValueError(f"cannot read {name} from {fname}: {e} (truncated or corrupt file?)") from None

    shapes = {name: shape for name, (shape, _) in manifest.items()}
    try:
        return shard_model(read, shapes, cfg, par, rank, comm)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


# ---------------------------------------------------------------- processes
def _worker(rank: int, par: Parallelism, store: str, task, args, results) -> None:
    torch.set_num_threads(1)  # N processes on a few cores: one thread each, or they oversubscribe
    # a rank left waiting in a collective (its peer died or went another way) fails after 5 minutes, not 30
    dist.init_process_group("gloo", store=dist.FileStore(store, par.world), rank=rank, world_size=par.world,
                            timeout=datetime.timedelta(minutes=5))
    try:
        out = task(rank, par, Comm(par, rank), *args)
        if rank == 0:  # as numpy: a shared-memory tensor would outlive the process that shares it
            results.put(_map_tensors(out, lambda t: t.detach().cpu().numpy()))
    except Exception as e:
        message = f"rank {rank} of {par.world} (tp={par.tp}, ep={par.ep}) failed: {e}"
        with open(f"{store}.error.{rank}", "w") as f:  # when written: a peer's failure follows the first one
            f.write(f"{time.time()!r}\t{message}")
        raise RuntimeError(message) from e
    finally:
        dist.destroy_process_group()


def spawn(task, tp: int = 1, ep: int = 1, *args):
    """Run ``task(rank, par, comm, *args)`` (a module-level function) on max(tp, ep) gloo processes; rank 0's
    return value. RuntimeError naming the failed rank when any rank raises (the others are stopped)."""
    par = Parallelism(tp, ep)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_worker, args=(par, os.path.join(tmp, "store"), task, args, results),
                               nprocs=par.world, join=True, start_method="spawn")
        except mp.ProcessRaisedException as e:
            # The first rank to fail is the cause; the others failed after it (a peer's closed connection).
            errors = sorted(Path(tmp).glob("store.error.*"), key=lambda p: float(p.read_text().split("\t", 1)[0]))
            raise RuntimeError(errors[0].read_text().split("\t", 1)[1] if errors else str(e)) from None
    return _map_tensors(results.get(), torch.from_numpy, numpy=True)


def _map_tensors(x, fn, numpy: bool = False):
    """x with every tensor (numpy array with ``numpy``) in nested dicts, lists and tuples replaced by fn(it)."""
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn, numpy) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn, numpy) for v in x)
    return fn(x) if (type(x).__name__ == "ndarray" if numpy else isinstance(x, torch.Tensor)) else x


def init_from_env(tp: int, ep: int) -> tuple[Parallelism, int, Comm]:
    """Join the process group torchrun set up (RANK, WORLD_SIZE in the environment): (par, rank, comm)."""
    par = Parallelism(tp, ep)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != par.world:
        raise ValueError(f"--tp {tp} --ep {ep} needs {par.world} processes, torchrun started {world}; use "
                         f"torchrun --nproc-per-node {par.world}")
    if not dist.is_initialized():
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    return par, dist.get_rank(), Comm(par, dist.get_rank())


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
