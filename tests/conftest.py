import dataclasses

import pytest
import torch

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
