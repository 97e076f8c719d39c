"""Messages between ranks cross as JSON and tensors (distributed/messages.py): nothing is unpickled."""

import tempfile

import pytest
import torch
import torch.distributed as dist

from minidsa.distributed.messages import all_gather_json, broadcast_json, broadcast_tensors, tensor_specs


@pytest.fixture
def one_rank_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_json_and_tensors_come_back_as_sent(one_rank_group):
    command = {"kind": "enqueue", "prompt": "naïve ✓", "ids": [1, 2, 3], "params": {"stop": ["\n"], "seed": 7}}
    assert broadcast_json(command) == command
    assert all_gather_json([command["prompt"], 41], 1) == [["naïve ✓", 41]]
    tensors = [torch.randn(3, 5).to(torch.bfloat16), torch.arange(4), torch.zeros(0, 2)]
    specs = tensor_specs(tensors)
    assert specs == [["torch.bfloat16", [3, 5]], ["torch.int64", [4]], ["torch.float32", [0, 2]]]
    for got, sent in zip(broadcast_tensors(tensors, specs), tensors):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_a_tensor_of_an_unlisted_dtype_is_refused_by_name():
    with pytest.raises(TypeError, match="complex64"):
        tensor_specs([torch.zeros(2, dtype=torch.complex64)])


def test_the_package_uses_no_object_collective():
    """broadcast_object_list and all_gather_object unpickle what another process sent."""
    from pathlib import Path

    import minidsa
    root = Path(minidsa.__file__).parent
    bad = [str(p.relative_to(root)) for p in root.rglob("*.py")
           if any(name in p.read_text() for name in ("_object_list(", "gather_object(", "scatter_object_list("))]
    assert not bad
