import dataclasses
import os
import shutil
import tempfile

# One CPU thread unless the caller chose otherwise: at these sizes two threads are no faster on a quiet
# 2-core machine and 10-30x slower as soon as another process shares the CPU (README, "Threads"). Set
# before torch is imported; subprocesses (the CLI, pip) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Everything the run puts in the temp folder (pytest keeps its tmp_path folders for three runs, torch
# creates a compile-cache folder, subprocesses write their own) goes into one folder, removed when
# the run ends: a test run leaves nothing behind.
RUN_TMP = tempfile.mkdtemp(prefix="minidsa-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = RUN_TMP

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a GPU the Triton kernels run in Triton's interpreter (numpy, on the CPU). The switch must be
# set before triton is first imported; a GPU machine compiles them for real unless told otherwise.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import minidsa  # noqa: E402  (after the environment switches above)


def tiny_config(**changes) -> minidsa.ModelConfig:
    """The tiny preset with top-level fields or whole sections replaced."""
    cfg = minidsa.load_config("tiny")
    return cfg.replace(**changes)


def with_indexer(cfg: minidsa.ModelConfig, **changes) -> minidsa.ModelConfig:
    return cfg.replace(indexer=dataclasses.replace(cfg.indexer, **changes))


@pytest.fixture(scope="session")
def tiny_model() -> minidsa.MiniDSA:
    return minidsa.load("tiny")


@pytest.fixture(scope="session")
def tiny_model64() -> minidsa.MiniDSA:
    """fp64 twin of tiny: comparisons of DSA selections across paths are then free of rounding near-ties."""
    return minidsa.MiniDSA(tiny_config(dtype="float64"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the tiny model, the directory it was saved to in many small shards, some of them holding routed
    experts only). One per test module, so a module may damage its copy without touching another's."""
    model = minidsa.load("tiny")
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path, max_shard_size="100KB")
    return model, path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def kernel_device() -> str:
    """Where kernel parity tests run: the GPU when there is one, else the interpreter on the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def pytest_unconfigure(config):
    shutil.rmtree(RUN_TMP, ignore_errors=True)
