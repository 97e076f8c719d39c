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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
