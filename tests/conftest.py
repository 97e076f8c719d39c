import dataclasses
import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (numpy, on the CPU). The switch must be
# set before triton is first imported; a GPU machine compiles them for real unless told otherwise.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import minidsa


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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def kernel_device() -> str:
    """Where kernel parity tests run: the GPU when there is one, else the interpreter on the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"
