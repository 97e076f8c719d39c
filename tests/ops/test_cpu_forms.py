"""The CPU forms (ops/_dispatch.py CPU_FORMS) equal their references exactly, on the score distributions
that break a careless top-k: ties, -0.0 against +0.0, -inf candidates, padding rows, short rows."""

import pytest
import torch

from minidsa import ops
from minidsa.ops._dispatch import CPU_FORMS, pick
from minidsa.ops.indexer import topk_cpu
from minidsa.ops.indexer.reference import topk_indices_ref

INF = float("inf")


def test_auto_picks_the_cpu_form_on_cpu_and_torch_the_reference():
    scores = torch.zeros(1, 1, 3)
    assert pick("topk_indices", "auto", topk_indices_ref, scores) is topk_cpu.topk_indices
    assert pick("topk_indices", "torch", topk_indices_ref, scores) is topk_indices_ref
    assert set(CPU_FORMS) <= set(ops.REFERENCES)


def _scores(kind: str, B: int, T: int, S: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randn(B, T, S, generator=g)
    if kind == "clustered":  # many scores differ only in their last bits, many are equal
        return 1.0 + torch.randint(0, 40, (B, T, S), generator=g).float() * 2.0 ** -20
    if kind == "equal":  # one value everywhere: positions decide
        return torch.full((B, T, S), 0.75)
    if kind == "spread":  # many binades, both signs
        return torch.randn(B, T, S, generator=g) * torch.exp2(torch.randint(-60, 60, (B, T, S), generator=g).float())
    s = torch.randn(B, T, S, generator=g)  # "mixed-sign": zeros of both signs and -inf candidates
    s[..., ::7] = -INF
    s[..., ::11] = -0.0
    s[..., 1::11] = 0.0
    return s


@pytest.mark.parametrize("kind", ["random", "clustered", "equal", "spread", "mixed-sign"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_cpu_form_equals_the_reference(kind, dtype):
    g = torch.Generator().manual_seed(3)
    B, T, S = 2, 63, 70
    scores = _scores(kind, B, T, S, g).to(dtype)
    q_pos = torch.stack([torch.arange(T) + 7, torch.randint(-1, S, (T,), generator=g)])  # second row: out of order
    q_pos[1, ::9] = -1  # padding queries: no candidate
    for k in (1, 5, 64, 80):  # 80 > S: padded with -1 after every candidate
        got = topk_cpu.topk_indices(scores, k, q_pos)
        assert got.dtype == torch.int32
        assert torch.equal(got, topk_indices_ref(scores, k, q_pos)), k


def test_topk_cpu_form_fp64_and_empty_go_to_the_reference():
    scores = torch.randn(1, 4, 5, dtype=torch.float64)
    q_pos = torch.arange(4).view(1, 4)
    assert torch.equal(topk_cpu.topk_indices(scores, 3, q_pos), topk_indices_ref(scores, 3, q_pos))
    assert topk_cpu.topk_indices(torch.zeros(1, 0, 5), 2, torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, 2)


def test_topk_cpu_form_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        topk_cpu.topk_indices(torch.tensor([[[float("nan"), 1.0]]]), 1, torch.tensor([[1]]))
