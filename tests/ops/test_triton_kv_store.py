"""The Triton paged KV store against its reference (interpreter on CPU, compiled on a GPU)."""

import pytest
import torch
from conftest import kernel_device

from minidsa.ops.kv_store.reference import store_kv_ref

pytest.importorskip("triton")
from minidsa.ops.kv_store.store_triton import store_kv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_store_kv_matches_reference(dtype):
    dev = kernel_device()
    g = torch.Generator().manual_seed(1)
    W = 60  # not a power of two: the column mask matters
    plane = torch.randn(5, 3, W, generator=g).to(dtype)
    # -1 first and in the middle (skipped rows), slots out of order, across blocks
    slots = torch.tensor([-1, 7, 0, -1, 14, 5], dtype=torch.int32)
    values = torch.randn(6, W, generator=g)
    if dtype == torch.float8_e4m3fn:
        values = values.to(dtype)  # the model stores already-quantised fp8 keys
    want = plane.clone()
    store_kv_ref(want, slots, values)
    got = plane.to(dev)
    store_kv(got, slots.to(dev), values.to(dev))
    # A store is a copy: bitwise equal, untouched rows included.
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_store_kv_all_skipped_and_empty():
    dev = kernel_device()
    plane = torch.randn(2, 4, 33).to(dev)
    before = plane.clone()
    store_kv(plane, torch.tensor([-1, -1], device=dev), torch.full((2, 33), float("nan"), device=dev))
    store_kv(plane, torch.zeros(0, dtype=torch.long, device=dev), torch.zeros(0, 33, device=dev))
    assert torch.equal(plane, before)


def test_store_kv_rejects_bad_shapes():
    plane = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="values"):
        store_kv(plane, torch.tensor([0, 1]), torch.zeros(2, 7))
    with pytest.raises(TypeError, match="kv_slots"):
        store_kv(plane, torch.tensor([0.0, 1.0]), torch.zeros(2, 8))


def test_store_kv_many_row_tiles():
    """More rows than one program's tile (W = 300 fp32 gives 8-row tiles): every tile, the ragged last one too."""
    dev = kernel_device()
    g = torch.Generator().manual_seed(2)
    plane = torch.randn(10, 8, 300, generator=g)
    slots = torch.randperm(80, generator=g)[:70]
    slots[::7] = -1
    values = torch.randn(70, 300, generator=g)
    want = plane.clone()
    store_kv_ref(want, slots, values)
    got = plane.to(dev)
    store_kv(got, slots.to(dev), values.to(dev))
    assert torch.equal(got.cpu(), want)
