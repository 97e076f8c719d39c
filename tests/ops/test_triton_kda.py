"""Triton KDA kernels (minidsa/ops/kda/recurrent_triton.py, chunk_triton.py) against the references, on tiny odd shapes.

Without a GPU the kernels run in Triton's interpreter (conftest.py), where every program instance
costs milliseconds: shapes stay tiny and odd (K = V = 60 or K = 20, V = 12 exercise every mask; H = 2
with HV = 4 exercises grouped value heads; T = 37 with chunk 16 and T = 70 with chunk 64 leave a
partial last chunk), and fp32 is used because the interpreter's tl.dot on bf16 is wrong
(docs/design.md §10). On a GPU the same tests run compiled, plus bf16 cases.

fp32 tolerance: kernel and reference compute in fp32 with unit-norm keys, beta < 1 and O(1) values,
so every sum has at most ~64 O(1) terms and the chunk's triangular solve stays O(1): the two differ
by summation order, by the chunked algorithm against the step-by-step one and (on a GPU) by the
hardware exp, a few 1e-7 measured in the interpreter. 5e-5 absolute and relative leaves two orders
of magnitude of room, while a wrong mask, decay or head mapping is off by 1e-2 or more.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from conftest import kernel_device  # noqa: E402

from minidsa.ops.kda import chunk_triton as chunk  # noqa: E402
from minidsa.ops.kda import recurrent_triton as rec  # noqa: E402
from minidsa.ops.kda import reference as ref_ops  # noqa: E402

DEV = kernel_device()
TOL = dict(atol=5e-5, rtol=5e-5)


def kda_inputs(B, T, H, HV, K, V, gate="mixed", dtype=torch.float32, seed=0):
    """Model-like inputs: unit-norm keys, beta in (0, 1), g = -5 sigmoid(.) per channel (docs/design.md §5)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    x = torch.randn(B, T, HV, K, generator=gen)
    shift = {"mixed": 0.0, "lower_bound": 8.0, "near_zero": -12.0}[gate]  # alpha ~ e^-5 / any / ~1
    g = -5.0 * torch.sigmoid(x + shift)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    return [t.to(DEV, dtype) for t in (q, k, v, g, beta)]


def state(B, HV, K, V, seed=1):
    return torch.randn(B, HV, K, V, generator=torch.Generator().manual_seed(seed)).to(DEV)


def check(got, want, tol=TOL):
    (o, s), (o_ref, s_ref) = got[:2], want[:2]  # the kernels' third result: kept states (tested below)
    assert o.dtype == o_ref.dtype and s.dtype == torch.float32 and o.shape == o_ref.shape
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, **tol)
    torch.testing.assert_close(s, s_ref.float(), **tol)


@pytest.mark.parametrize("name", ["kda_recurrent", "kda_chunk"])
def test_signatures_match_the_references(name):
    kern = {"kda_recurrent": rec, "kda_chunk": chunk}[name]
    assert inspect.signature(getattr(kern, name)) == inspect.signature(getattr(ref_ops, name + "_ref"))


# ------------------------------------------------------------------------------ recurrence
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_matches_reference_gva(with_state):
    q, k, v, g, beta = kda_inputs(B=2, T=5, H=2, HV=4, K=20, V=12)
    s0 = state(2, 4, 20, 12) if with_state else None
    check(rec.kda_recurrent(q, k, v, g, beta, 0.7, s0), ref_ops.kda_recurrent_ref(q, k, v, g, beta, 0.7, s0))


def test_recurrent_decode_batch_of_states_in_column_tiles():
    # Decode: T = 1 for a batch of 3 states, K = V = 60 (masked to 64) in four tiles of 16 columns.
    q, k, v, g, beta = kda_inputs(B=3, T=1, H=1, HV=2, K=60, V=60)
    s0 = state(3, 2, 60, 60)
    got = rec._launch_recurrent(q, k, v, g, beta, 60 ** -0.5, s0, block_v=16)
    check(got, ref_ops.kda_recurrent_ref(q, k, v, g, beta, None, s0))
    check(rec.kda_recurrent(q, k, v, g, beta, None, s0), ref_ops.kda_recurrent_ref(q, k, v, g, beta, None, s0))


# --------------------------------------------------------------------------------- chunked
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrence_gva_partial_chunk(with_state):
    # T = 37 in chunks of 16: the third chunk holds 5 tokens, the rest of its tile is padding.
    q, k, v, g, beta = kda_inputs(B=1, T=37, H=2, HV=4, K=20, V=12)
    s0 = state(1, 4, 20, 12) if with_state else None
    want = ref_ops.kda_recurrent_ref(q, k, v, g, beta, None, s0)
    check(chunk.kda_chunk(q, k, v, g, beta, None, s0, chunk_size=16), want)


def test_chunk_64_odd_widths_strong_decay():
    # The model's chunk of 64, T = 70 (a 6-token tail), K = V = 60, and g near -5 on every channel:
    # over a full chunk G falls to about -320, where exp(-G) would overflow fp32 (the kernel never
    # forms it) and exp(G) underflows to 0, harmlessly.
    q, k, v, g, beta = kda_inputs(B=1, T=70, H=1, HV=2, K=60, V=60, gate="lower_bound")
    assert float(g.sum(1).min()) < -300
    s0 = state(1, 2, 60, 60)
    check(chunk.kda_chunk(q, k, v, g, beta, None, s0), ref_ops.kda_recurrent_ref(q, k, v, g, beta, None, s0))


def test_chunk_non_power_of_two_chunk_weak_decay_and_sliced_tiles():
    # chunk_size 20 runs in 32-row tiles (rows 20..31 are padding); alpha ~ 1 lets the state carry
    # everything across chunks. The GPU's slicing, in the interpreter: V = 60 in four tiles of 16
    # through the state walk and the output, K = 20 (padded to 32) in two slices of 16 for the pair
    # matrices, W and U in slices of 16 columns.
    q, k, v, g, beta = kda_inputs(B=2, T=37, H=1, HV=1, K=20, V=60, gate="near_zero")
    s0 = state(2, 1, 20, 60)
    got = chunk._launch_chunk(q, k, v, g, beta, 0.3, s0, chunk_size=20, config=dict(BV=16, out_BV=16, KC=16, WC=16))
    check(got, ref_ops.kda_recurrent_ref(q, k, v, g, beta, 0.3, s0))


def test_chunk_shorter_than_one_chunk_and_empty():
    q, k, v, g, beta = kda_inputs(B=2, T=3, H=1, HV=2, K=20, V=12)
    check(chunk.kda_chunk(q, k, v, g, beta), ref_ops.kda_chunk_ref(q, k, v, g, beta))
    s0 = state(1, 2, 20, 12)
    empty = [t[:1, :0] for t in (q, k, v, g, beta)]
    for op in (chunk.kda_chunk, rec.kda_recurrent):
        o, s = op(*empty, None, s0)[:2]
        assert o.shape == (1, 0, 2, 12) and torch.equal(s, s0) and s.data_ptr() != s0.data_ptr()


def test_kept_states_equal_the_reference():
    # Kept states come from the state walk (the chunk starts and the end): pairs out of order, t = 0, t = T
    # (a partial last chunk), a padding pair, two rows; the output and final state are unchanged by asking.
    q, k, v, g, beta = kda_inputs(B=2, T=37, H=1, HV=2, K=20, V=12)
    s0 = state(2, 2, 20, 12)
    pairs = torch.tensor([(1, 16), (0, 37), (-1, 0), (0, 0), (1, 32)], device=DEV)
    got = chunk.kda_chunk(q, k, v, g, beta, None, s0, 16, pairs)
    want = ref_ops.kda_chunk_ref(q, k, v, g, beta, None, s0, 16, pairs)
    check(got, want)
    assert got[2].shape == (5, 2, 20, 12) and not got[2][2].any()
    torch.testing.assert_close(got[2], want[2], **TOL)
    plain = chunk.kda_chunk(q, k, v, g, beta, None, s0, 16)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]) and plain[2].shape[0] == 0


def test_lengths_skip_whole_chunks_like_the_reference():
    # Rows ending at 37 (a partial last chunk), 0 and 16 tokens of 37, chunk 16, with non-zero padding that the
    # op must ignore; a kept state in a skipped chunk's start and at T are the row's final state.
    q, k, v, g, beta = kda_inputs(B=3, T=37, H=1, HV=2, K=20, V=12)
    s0 = state(3, 2, 20, 12)
    lengths = torch.tensor([37, 0, 16], device=DEV)
    pairs = torch.tensor([(2, 32), (1, 37), (0, 16)], device=DEV)
    got = chunk.kda_chunk(q, k, v, g, beta, None, s0, 16, pairs, lengths)
    want = ref_ops.kda_chunk_ref(q, k, v, g, beta, None, s0, 16, pairs, lengths)
    check(got, want)
    torch.testing.assert_close(got[2], want[2], **TOL)
    assert not got[0][1].any() and not got[0][2, 16:].any()
    torch.testing.assert_close(got[2][0], got[1][2], **TOL)


# ------------------------------------------------------------------------------- contracts
def test_initial_state_is_not_modified_and_runs_are_bitwise_equal():
    q, k, v, g, beta = kda_inputs(B=1, T=19, H=1, HV=2, K=20, V=12)
    s0 = state(1, 2, 20, 12)
    before = s0.clone()
    for op, extra in ((chunk.kda_chunk, (16,)), (rec.kda_recurrent, ())):
        (o1, s1), (o2, s2) = (op(q, k, v, g, beta, None, s0, *extra)[:2] for _ in range(2))
        assert torch.equal(s0, before)
        assert torch.equal(o1.view(torch.int32), o2.view(torch.int32))
        assert torch.equal(s1.view(torch.int32), s2.view(torch.int32))


def test_fp64_inputs_keep_the_reference_contract():
    q, k, v, g, beta = kda_inputs(B=1, T=4, H=1, HV=1, K=8, V=6, dtype=torch.float64)
    for op, ref in ((chunk.kda_chunk, ref_ops.kda_chunk_ref), (rec.kda_recurrent, ref_ops.kda_recurrent_ref)):
        o, s = op(q, k, v, g, beta)[:2]
        o_ref, s_ref = ref(q, k, v, g, beta)[:2]
        assert o.dtype == s.dtype == torch.float64 and torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_bad_input_raises_like_the_reference():
    q, k, v, g, beta = kda_inputs(B=1, T=2, H=2, HV=4, K=8, V=6)
    s0 = state(1, 4, 8, 6)
    bad = [
        (q[0], k, v, g, beta, None, s0), (q, k[..., :4], v, g, beta, None, s0), (q, k, v[:, :, :3], g, beta, None, s0),
        (q, k, v, g[..., :4], beta, None, s0), (q, k, v, g, beta[..., :1], None, s0), (q, k, v, g, beta, None, s0[0]),
        (q.int(), k, v, g, beta, None, s0), (q, k, v, g, beta.tolist(), None, s0),
    ]
    cases = [(rec.kda_recurrent, ref_ops.kda_recurrent_ref, args) for args in bad]
    cases += [(chunk.kda_chunk, ref_ops.kda_chunk_ref, args + (cs,)) for args in bad[:2] for cs in (16,)]
    cases += [(chunk.kda_chunk, ref_ops.kda_chunk_ref, (q, k, v, g, beta, None, s0, cs)) for cs in (0, True, 2.0)]
    for op, ref, args in cases:
        with pytest.raises((TypeError, ValueError)) as want:
            ref(*args)
        with pytest.raises(want.type, match=str(want.value).replace("(", r"\(").replace(")", r"\)")):
            op(*args)


# ------------------------------------------------------------------------------- GPU: bf16
def rms_ratio(got, want):
    """flash-linear-attention's criterion: RMS of the difference over RMS of the reference."""
    return float((got.float() - want.float()).pow(2).mean().sqrt() / want.float().pow(2).mean().sqrt())


@pytest.mark.skipif(DEV != "cuda", reason="bf16 tl.dot is wrong in the interpreter; GPU only")
@pytest.mark.parametrize("T", [1, 200])
def test_bf16_inputs_on_gpu(T):
    # The reference sees the same bf16 values (converted to fp32). The kernel rounds its tensor-core
    # operands (exp-scaled keys, M, the state in the dots) to bf16, 2^-9 relative each, as fla does;
    # the output itself is bf16. fla accepts an RMS ratio of 5e-3 against its fp32 naive recurrence:
    # the same bar here, plus a loose max bound that still catches a wrong row or head.
    q, k, v, g, beta = kda_inputs(B=2, T=T, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16)
    g = g.float()  # the model hands fp32 log-decays
    s0 = state(2, 4, 128, 128)
    o_ref, s_ref = ref_ops.kda_recurrent_ref(q, k, v, g, beta, None, s0)
    for op in (rec.kda_recurrent, chunk.kda_chunk):
        o, s = op(q, k, v, g, beta, None, s0)[:2]
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        assert rms_ratio(o, o_ref) < 5e-3 and rms_ratio(s, s_ref) < 5e-3
        torch.testing.assert_close(o.float(), o_ref.float(), atol=0.1, rtol=0.05)
