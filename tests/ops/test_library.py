"""The kernels' custom-op registrations (ops/_library.py): one schema and one fake per kernel, with the
reference's arguments, and fakes whose outputs have the shapes and dtypes the ops really return."""

import inspect

import pytest
import torch

import minidsa
from minidsa import ops
from minidsa.ops._library import FAKES, SCHEMAS


def test_every_kernel_has_a_schema_and_a_fake():
    assert set(SCHEMAS) == set(FAKES) == set(ops.TRITON_KERNELS)


@pytest.mark.parametrize("op", sorted(ops.TRITON_KERNELS))
def test_schemas_name_the_references_arguments(op):
    schema = torch._C.parse_schema(f"minidsa::{op}{SCHEMAS[op][0]}")
    reference = ops.REFERENCES[op] if op in ops.REFERENCES else getattr(ops, f"{op}_ref")
    assert [a.name for a in schema.arguments] == list(inspect.signature(reference).parameters)
    assert [a.name for a in schema.arguments] == list(inspect.signature(FAKES[op]).parameters)
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutated == set(SCHEMAS[op][1])


def _meta(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    return tuple(_meta(t) for t in x)


def test_fakes_match_what_the_ops_return(monkeypatch):
    """Every op call of a tiny model's prefill (past the direct-expert limit), decode and no-cache forward,
    plus the SiTU-GLU pair: the fake, given the same inputs, promises the outputs the reference gave."""
    calls = []
    for op in ops.TRITON_KERNELS:
        name = f"{op}_ref"
        original = getattr(ops, name)

        def spy(*args, _op=op, _f=original):
            out = _f(*args)
            calls.append((_op, args, out))
            return out
        monkeypatch.setattr(ops, name, spy)
    model = minidsa.load("tiny").set_backend("torch")
    cache = model.new_cache()
    sid = cache.add_sequence()
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.randint(0, 256, (1, 70), generator=gen), cache=cache, seq_ids=[sid])
        model(torch.randint(0, 256, (1, 1), generator=gen), cache=cache, seq_ids=[sid])
        model(torch.randint(0, 256, (2, 9), generator=gen))
        model(torch.randint(0, 256, (2, 1), generator=gen))  # one step without a cache: the plain recurrence
        g, u = torch.randn(3, 5), torch.randn(3, 5)
        ops.situ_glu(g, u, 4.0, 25.0)
        ops.situ_glu_backward(g, u, torch.randn(3, 5), 4.0, 25.0)
    seen = {op for op, _, _ in calls}
    assert {"situ_glu", "situ_glu_backward", "store_kv", "paged_index_scores", "topk_indices", "sparse_mla_decode",
            "sparse_mla_prefill", "kda_recurrent", "kda_chunk", "mxfp4_to_fp8", "expert_mlp_fp8",
            "expert_mlp_mxfp4", "linear", "moe_route", "kda_decode", "moe_plan", "output_gate", "kda_inputs",
            "rms_norm"} <= seen
    for op, args, out in calls:
        assert _meta(FAKES[op](*args)) == _meta(out), op
