"""A rank that cannot load its part, or dies, is named by every rank in one error, at once."""

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import minidsa
from minidsa.distributed import Parallelism, logits, spawn, tensor_slice
from minidsa.formats.shards import INDEX_NAME, file_checksum, read_header, read_index

ROOT = Path(__file__).resolve().parents[2]
IDS, DECODE = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 1))
Q_PROJ = "language_model.model.layers.1.self_attn.q_proj.weight"  # column-parallel: rank 1 holds the second half


@pytest.fixture
def ckpt(saved, tmp_path):
    """A copy of the tiny checkpoint in small shards (conftest's ``saved``), free to damage."""
    shutil.copytree(saved[1], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def rank_1_rows(name: str, par: Parallelism) -> slice:
    cfg = minidsa.load_config("tiny")
    full = minidsa.checkpoint_manifest(cfg)[name][0]
    return tensor_slice(name, full, par, 1, cfg)[0]


def rewrite_shard_of(path: Path, name: str, change) -> str:
    """Apply ``change(tensor)`` (in place) to ``name`` in its shard and re-record the shard's checksum, as a
    tool writing valid safetensors would: only the values themselves can then give the damage away."""
    index = json.loads((path / INDEX_NAME).read_text())
    fname = index["weight_map"][name]
    tensors = load_file(str(path / fname))
    change(tensors[name])
    save_file(tensors, str(path / fname))
    index["metadata"]["checksums"][fname] = file_checksum(path / fname)
    (path / INDEX_NAME).write_text(json.dumps(index))
    return fname


def test_a_flipped_exponent_bit_in_rank_1s_rows_fails_the_load_on_its_checksum(ckpt):
    par = Parallelism(2, 1)
    fname = read_index(ckpt).weight_map[Q_PROJ]
    header, _ = read_header(ckpt / fname)
    start = header[Q_PROJ]["data_offsets"][0]
    row = header[Q_PROJ]["shape"][1] * 4  # float32
    with open(ckpt / fname, "r+b") as f:  # the top exponent bit of rank 1's first element: x * 2^+-128, finite
        data_start = 8 + int.from_bytes(f.read(8), "little")
        at = data_start + start + rank_1_rows(Q_PROJ, par).start * row + 3
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))
    # both ranks read that shard (rank 0 its own rows of the same tensor), so both find it damaged
    with pytest.raises(RuntimeError, match=rf"ranks 0, 1 of 2 \(tp=2, ep=1\) failed: shard {fname} does not match "
                                           rf"its checksum in {INDEX_NAME} .*opened to read tensor"):
        logits(str(ckpt), IDS, DECODE, tp=2)


@pytest.mark.slow  # two processes
def test_a_nan_in_rank_1s_rows_is_refused_at_load_naming_rank_tensor_and_shard(ckpt):
    par = Parallelism(2, 1)
    rows = rank_1_rows(Q_PROJ, par)
    fname = rewrite_shard_of(ckpt, Q_PROJ, lambda t: t[rows.start + 2].fill_(float("nan")))
    # rank 0's rows are finite: it loads, and learns of rank 1's failure before any all-reduce
    with pytest.raises(RuntimeError, match=rf"^rank 1 of 2 \(tp=2, ep=1\) failed: tensor {Q_PROJ} holds \d+ NaN "
                                           rf"and 0 Inf .*found in its slice \[{rows.start}:{rows.stop}, .*read "
                                           rf"from shard {fname}"):
        logits(str(ckpt), IDS, DECODE, tp=2)


@pytest.mark.slow
def test_the_e8m0_nan_code_in_rank_1s_expert_is_refused_at_load(ckpt):
    name = "language_model.model.layers.2.block_sparse_moe.experts.6.w2.weight_scale"  # experts 4-7: rank 1's
    fname = rewrite_shard_of(ckpt, name, lambda t: t[0, 0].fill_(0xFF))
    with pytest.raises(RuntimeError, match=rf"^rank 1 of 2 \(tp=1, ep=2\) failed: tensor {name} holds the E8M0 "
                                           rf"NaN code 0xFF.*shard {fname}"):
        logits(str(ckpt), IDS, DECODE, ep=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_follower_killed_mid_generate_ends_rank_0_with_one_line():
    """Two CLI processes joined by hand (no torchrun); rank 1 is killed once rank 0 prints text."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "minidsa", "generate", "hello", "--config", "tiny", "--tp", "2", "--temperature",
           "0", "--max-new-tokens", "120", "--ignore-eos", "--no-progress"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for r in (0, 1)]
    try:
        assert select.select([procs[0].stdout], [], [], 120)[0], "rank 0 printed nothing in 120 s"
        assert os.read(procs[0].stdout.fileno(), 1), procs[0].communicate()[1].decode()
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        start = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    lines = err.decode().strip().splitlines()
    assert procs[0].returncode == 2 and len(lines) == 1, err.decode()
    assert lines[0].startswith(f"error: rank 1 of 2 (pid {procs[1].pid}) exited while rank 0 was in a "), lines[0]
    assert took < 10, f"rank 0 took {took:.1f} s to stop"


def _die_on_rank_1(rank, par, comm):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return comm.tp_all_reduce(torch.ones(3))


@pytest.mark.slow
def test_a_spawned_rank_that_dies_is_named():
    with pytest.raises(RuntimeError, match=r"^rank 1 of 2 (\(tp=2, ep=1\) died \(signal SIGKILL\)|\(pid \d+\) "
                                           r"exited while rank 0 was in a tensor-parallel all-reduce)"):
        spawn(_die_on_rank_1, 2, 1)
