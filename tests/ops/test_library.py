"""The kernels' custom-op registrations (ops/_library.py): one schema and one fake per kernel, with the
reference's arguments, and fakes whose outputs have the shapes and dtypes the ops really return."""

import inspect

import pytest
import torch

import minidsa
from minidsa import ops


def test_every_public_op_is_its_reference_one_hop_away():
    """``ops.<op>`` is the decorated reference: "go to definition" lands on the formula in ``<op>/reference.py``,
    and ``.reference`` / ``__wrapped__`` is that function undispatched."""
    for name, spec in ops.OPS.items():
        public = getattr(ops, name)
        assert public.__wrapped__ is public.reference is spec.reference is ops.REFERENCES[name], name
        assert spec.reference.__module__.endswith(".reference") and spec.reference.__name__ == name, name
        assert getattr(ops, f"{name}_ref") is spec.reference, name


def test_every_kernel_has_a_schema_and_a_fake():
    assert set(ops.TRITON_KERNELS) <= set(ops.OPS)
    assert all(ops.OPS[op].fake is not None for op in ops.TRITON_KERNELS)


@pytest.mark.parametrize("op", sorted(ops.TRITON_KERNELS))
def test_schemas_name_the_references_arguments(op):
    spec = ops.OPS[op]
    schema = torch._C.parse_schema(f"minidsa::{op}{spec.schema}")
    assert [a.name for a in schema.arguments] == list(inspect.signature(ops.REFERENCES[op]).parameters)
    assert [a.name for a in schema.arguments] == list(inspect.signature(spec.fake).parameters)
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutated == set(spec.mutates)


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
        signature = inspect.signature(ops.REFERENCES[op])

        def spy(*args, _op=op, _f=ops.REFERENCES[op], _sig=signature, **kwargs):
            bound = _sig.bind(*args, **kwargs)
            bound.apply_defaults()
            out = _f(*bound.args)
            calls.append((_op, bound.args, out))
            return out
        monkeypatch.setattr(ops.OPS[op], "reference", spy)  # what the public op calls
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
        assert _meta(ops.OPS[op].fake(*args)) == _meta(out), op
