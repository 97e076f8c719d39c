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


def routing(N, E, k, seed=0):
    """ids [N, k] (distinct per row) and their weights, as the router makes them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    return ids, torch.rand(N, k, generator=g) + 0.01


@pytest.mark.parametrize("N,E,k", [(1, 64, 8), (7, 60, 6), (33, 32, 1), (3, 5, 4), (40, 64, 8)])
@pytest.mark.parametrize("launches", ["one", "three"])
def test_plan_matches_reference(N, E, k, launches, monkeypatch):
    """Slots (routed ascending, then placeholders), routing and the count: exactly the reference's, on odd
    expert counts, a batch routing to every expert (3 x 4 pairs over 5) and one using a few; by the
    decode-sized single program and by the prefill-sized three launches."""
    from minidsa.ops.moe_router import plan_triton
    from minidsa.ops.moe_router.plan_triton import moe_plan
    if launches == "three":
        monkeypatch.setattr(plan_triton, "MAX_PAIRS", 0)
    ids, w = routing(N, E, k, seed=N + E)
    got = moe_plan(ids.to(kernel_device()), w.to(kernel_device()), E)
    want = ops.moe_plan(ids, w, E, backend="torch")
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b)
    m = min(N * k, E)
    assert want[0].shape == (m,) and want[1].shape == (m, N) and int(want[2]) == len(ids.unique())
    # each token's weights sit in the rows of its experts, nothing else: the routing matrix is the routing itself
    rows = {int(e): j for j, e in enumerate(want[0])}
    dense = torch.zeros(m, N)
    for t in range(N):
        for e, x in zip(ids[t].tolist(), w[t].tolist()):
            dense[rows[e], t] = x
    assert torch.equal(want[1], dense)


@pytest.mark.parametrize("launches", ["one", "three"])
def test_plan_of_another_rank_s_experts_mapped_to_zero(launches, monkeypatch):
    """Expert parallelism: a row's other-rank experts come as id 0 with weight 0, beside a real expert 0."""
    from minidsa.ops.moe_router import plan_triton
    from minidsa.ops.moe_router.plan_triton import moe_plan
    if launches == "three":
        monkeypatch.setattr(plan_triton, "MAX_PAIRS", 0)
    ids = torch.tensor([[0, 0, 3], [2, 0, 0]])
    w = torch.tensor([[0.5, 0.0, 0.25], [0.75, 0.0, 0.0]])
    got = moe_plan(ids.to(kernel_device()), w.to(kernel_device()), 6)
    assert got[0].tolist() == [0, 2, 3, 1, 4, 5] and int(got[2]) == 3
    assert got[1].cpu().tolist() == [[0.5, 0.0], [0.0, 0.75], [0.25, 0.0]] + [[0.0, 0.0]] * 3
    for a, b in zip(got, ops.moe_plan(ids, w, 6, backend="torch")):
        assert torch.equal(a.cpu(), b)
