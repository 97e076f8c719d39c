"""The router kernel against its sort-based reference (interpreter on CPU, compiled on a GPU)."""

import pytest
import torch
from conftest import kernel_device

from minidsa import ops
from minidsa.ops.moe_router.reference import moe_route_ref

pytest.importorskip("triton")
from minidsa.ops.moe_router.route_triton import moe_route  # noqa: E402


@pytest.mark.parametrize("N,E,k", [(1, 64, 8), (5, 60, 6), (33, 32, 1)])  # top_k not a power of two; k = 1
def test_route_matches_reference(N, E, k):
    dev = kernel_device()
    g = torch.Generator().manual_seed(N * E + k)
    logits, bias = torch.randn(N, E, generator=g) * 3, torch.randn(E, generator=g) * 0.1
    ids, w = moe_route(logits.to(dev), bias.to(dev), k, 2.5)
    want_ids, want_w = moe_route_ref(logits, bias, k, 2.5)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), want_ids)  # seeded random scores: no two within an ulp
    # the same fp32 expression up to exp's last bits and the order of a k-term sum
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-6, atol=1e-7)


def test_route_ties_go_to_the_lower_id():
    dev = kernel_device()
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.0, 0.0])
    ids, _ = moe_route(logits.to(dev), bias.to(dev), 3, 1.0)
    want, _ = moe_route_ref(logits, bias, 3, 1.0)
    assert torch.equal(ids.cpu(), want) and want.tolist() == [[3, 1, 2]]  # 3 by its bias; 1, 2 before 4


def test_bad_top_k_is_named():
    with pytest.raises(ValueError, match="top_k=9"):
        ops.moe_route(torch.zeros(2, 8), torch.zeros(8), 9, 1.0)
