"""Paged ops against the dense ops they must equal, and the backend dispatcher.

The caches here are built with plain Python loops over the block table (not with ops.paged_kv_slots),
and every byte of a plane that the op must not read holds NaN, so any stray read shows up.
"""

import ast
import importlib.util
import inspect
import sys
import types

import pytest
import torch

from minidsa import ops
from minidsa.formats.fp8 import quantize_fp8_pow2
from minidsa.ops import _checks, _dispatch

NAN = float("nan")


def interleaved_table(lens, bs, max_blocks, num_blocks, seed):
    """Physical blocks in a random order, dealt round-robin to the sequences, -1 padded."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    need = [-(-n // bs) for n in lens]
    owned = [[] for _ in lens]
    while any(len(o) < n for o, n in zip(owned, need)):
        for o, n in zip(owned, need):
            if len(o) < n:
                o.append(perm.pop(0))
    assert perm, "leave some physical blocks unowned: they hold NaN"
    table = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    for b, o in enumerate(owned):
        table[b, :len(o)] = torch.tensor(o, dtype=torch.int32)
    return table


def to_plane(dense, table, bs, num_blocks, keep):
    """NaN plane [num_blocks, bs, W] holding dense[b, p] at its paged slot wherever keep(b, p)."""
    plane = torch.full((num_blocks, bs, dense.shape[-1]), NAN, dtype=dense.dtype)
    for b in range(dense.shape[0]):
        for p in range(dense.shape[1]):
            phys = int(table[b, p // bs]) if p // bs < table.shape[1] else -1
            if phys >= 0 and keep(b, p):
                plane[phys, p % bs] = dense[b, p]
    return plane


def bits(t):
    """Bit pattern, so NaN compares equal to itself."""
    return t.view({1: torch.uint8, 4: torch.int32, 8: torch.int64}[t.element_size()])


# ------------------------------------------------------------------ store_kv
@pytest.fixture(params=["host", "graph-safe"])
def store_path(request, monkeypatch):
    """store_kv reads the slots on the host for CPU tensors; switching host reads off runs the path a
    device takes (the -1 rows repeat the first real write), so both are tested on the CPU."""
    if request.param == "graph-safe":
        monkeypatch.setattr(_checks, "CHECK_VALUES_ON_HOST", False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_store_kv_writes_rows_at_slots_and_skips_minus_one(dtype, store_path):
    NB, bs, W = 4, 5, 7
    plane = torch.full((NB, bs, W), NAN).to(dtype)
    slots = torch.tensor([-1, 13, 2, -1, 19, 0, -1], dtype=torch.int32)  # starts with -1, hits row 0
    values = torch.randn(len(slots), W)
    ops.store_kv(plane, slots, values)
    flat, want = bits(plane.view(-1, W)), bits(values.to(dtype))
    written = [int(s) for s in slots if s >= 0]
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], want[i]), f"row {i} not at slot {s}"
    nan_row = bits(torch.full((W,), NAN).to(dtype))
    for s in set(range(NB * bs)) - set(written):
        assert torch.equal(flat[s], nan_row), f"slot {s} was written by a -1 row"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_store_kv_all_padding_leaves_plane_bitwise_unchanged(dtype, store_path):
    plane = torch.randn(3, 5, 6).to(dtype)
    plane[0, 0, 1] = NAN  # row 0 is the one the reference rewrites onto itself
    before = bits(plane).clone()
    ops.store_kv(plane, torch.full((4,), -1, dtype=torch.int64), torch.randn(4, 6))
    assert torch.equal(bits(plane), before)


def test_store_kv_rejects_a_slot_past_the_plane():
    with pytest.raises(ValueError, match="slot 15; the plane has 15 slots"):
        ops.store_kv(torch.zeros(3, 5, 2), torch.tensor([-1, 15]), torch.ones(2, 2))


# ------------------------------------------------------------------ paged_index_scores
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_index_scores_equals_index_scores(fp8):
    lens, bs, MB, NB = [13, 29], 5, 7, 12  # 3 + 6 blocks owned, 3 unowned (NaN)
    B, T, H, D = 2, 3, 4, 60
    q, w = torch.randn(B, T, H, D), torch.randn(B, T, H)
    keys = torch.randn(B, MB * bs, D)
    table = interleaved_table(lens, bs, MB, NB, seed=1)
    in_seq = lambda b, p: p < lens[b]  # noqa: E731 -- positions >= len stay NaN too: they must give -inf
    if fp8:
        values, kscale = quantize_fp8_pow2(keys)
        key_plane = to_plane(values.float(), table, bs, NB, in_seq).to(torch.float8_e4m3fn)
        scale_plane = to_plane(kscale, table, bs, NB, in_seq)
        keys = values.float() * kscale  # what the op must see: the dequantised keys
    else:
        key_plane, scale_plane = to_plane(keys, table, bs, NB, in_seq), None
    assert torch.isnan(key_plane.float()).any()
    got = ops.paged_index_scores(q, w, key_plane, scale_plane, table, torch.tensor(lens, dtype=torch.int32),
                                 D ** -0.5)
    assert got.shape == (B, T, MB * bs) and got.dtype == torch.float32
    for b, n in enumerate(lens):
        assert torch.isfinite(got[b, :, :n]).all(), "a NaN key outside the sequence leaked in"
        ref = ops.index_scores(q[b:b + 1], keys[b:b + 1, :n], w[b:b + 1], D ** -0.5)
        # Same fp32 products; the two einsums may block a length-60 dot product differently: ulps of O(1).
        torch.testing.assert_close(got[b:b + 1, :, :n], ref, atol=1e-5, rtol=1e-5)
        assert (got[b, :, n:] == float("-inf")).all()


def test_padded_rows_and_causal_bounds_cost_nothing_and_change_nothing():
    """A padded batch (q_pos -1 on a row's tail, a row of padding only) through the host path, which scores each
    row's live queries against the keys up to its last position only: equal to scoring everything and masking
    by the same rules; top-k gives -1 on every padding query and the full sort's answer elsewhere."""
    lens, bs, MB, NB = [13, 29, 6], 5, 7, 12
    B, T, H, D = 3, 6, 4, 60
    q, w = torch.randn(B, T, H, D), torch.randn(B, T, H)
    table = interleaved_table(lens, bs, MB, NB, seed=1)
    key_plane = to_plane(torch.randn(B, MB * bs, D), table, bs, NB, lambda b, p: p < lens[b])
    q_pos = torch.tensor([[9, 10, 11, 12, -1, -1], [20, 21, 22, 23, 24, 25], [-1] * 6])
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = ops.paged_index_scores(q, w, key_plane, None, table, lens_t, D ** -0.5, q_pos)
    full = ops.paged_index_scores(q, w, key_plane, None, table, lens_t, D ** -0.5)  # no bound: every pair scored
    want = full.masked_fill(torch.arange(MB * bs).view(1, 1, -1) > q_pos.unsqueeze(-1), float("-inf"))
    # The same fp32 products; an einsum over fewer rows may block the length-60 dot differently: ulps of O(1).
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.isinf(), want.isinf())
    idx = ops.topk_indices(got, 4, q_pos)
    assert (idx[q_pos < 0] == -1).all()
    real = q_pos >= 0
    assert torch.equal(idx[real], ops.topk_indices(got[real].unsqueeze(0), 4, q_pos[real].unsqueeze(0))[0])
    assert torch.equal(idx[1], ops.topk_indices(got[1:2], 4, q_pos[1:2])[0])


# ------------------------------------------------------------------ sparse_mla_decode
def test_sparse_mla_decode_equals_sparse_attention_on_dense_latents():
    lens, bs, MB, NB = [13, 29], 5, 7, 12
    B, T, H, r, dr, K = 2, 4, 3, 60, 12, 7
    # fp64 throughout (the op keeps it): both sides then agree to rounding of a few fp64 ulps.
    f64 = dict(dtype=torch.float64)
    q_latent, q_pe = torch.randn(B, T, H, r, **f64), torch.randn(B, T, H, dr, **f64)
    c_kv, k_pe = torch.randn(B, max(lens), r, **f64), torch.randn(B, max(lens), dr, **f64)
    g = torch.Generator().manual_seed(2)
    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            n = int(torch.randint(1, K + 1, (), generator=g))
            idx[b, t, torch.randperm(K, generator=g)[:n]] = torch.randperm(lens[b], generator=g)[:n].int()
    idx[0, 2] = -1  # a query with nothing selected
    table = interleaved_table(lens, bs, MB, NB, seed=3)
    selected = lambda b, p: bool((idx[b] == p).any())  # noqa: E731 -- every other row is NaN
    kv_plane, pe_plane = to_plane(c_kv, table, bs, NB, selected), to_plane(k_pe, table, bs, NB, selected)
    assert torch.isnan(kv_plane).any()
    scale = (20 + dr) ** -0.5
    got = ops.sparse_mla_decode(q_latent, q_pe, kv_plane, pe_plane, table, idx, scale)
    assert got.shape == (B, T, H, r) and got.dtype == torch.float64
    assert torch.isfinite(got).all(), "an unselected (NaN) cache row was read"
    assert torch.equal(got[0, 2], torch.zeros(H, r, **f64))
    ref = ops.sparse_attention(torch.cat([q_latent, q_pe], -1), torch.cat([c_kv, k_pe], -1).unsqueeze(2),
                               c_kv.unsqueeze(2), idx, scale)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------ sparse_mla_prefill
def test_sparse_mla_prefill_equals_sparse_attention_on_decompressed_kv():
    lens, bs, MB, NB = [23, 41], 5, 10, 17  # 5 + 9 blocks owned, 3 unowned
    B, T, H, r, dr, dn, dv, K = 2, 70, 2, 60, 12, 20, 14, 8  # T: one full 64-query tile and a ragged one
    f64 = dict(dtype=torch.float64)  # fp64 kept end to end: agreement to fp64 rounding
    q = torch.randn(B, T, H, dn + dr, **f64)
    c_kv, k_pe = torch.randn(B, MB * bs, r, **f64), torch.randn(B, MB * bs, dr, **f64)
    kv_b = torch.randn(H * (dn + dv), r, **f64) * r ** -0.5
    # Prefill gathers whole selected blocks, so NaN may only sit in blocks no query selects: logical
    # block 1 of sequence 0, block 4 of sequence 1, and the unowned physical blocks.
    poisoned = {(0, 1), (1, 4)}
    allowed = [[p for p in range(n) if (b, p // bs) not in poisoned] for b, n in enumerate(lens)]
    g = torch.Generator().manual_seed(4)
    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            n = int(torch.randint(0, K + 1, (), generator=g))
            pick = torch.randperm(len(allowed[b]), generator=g)[:n].tolist()
            idx[b, t, torch.randperm(K, generator=g)[:n]] = torch.tensor([allowed[b][i] for i in pick],
                                                                        dtype=torch.int32)
    idx[0, 5] = -1
    idx[1, 64:] = -1  # a whole tile with nothing selected
    table = interleaved_table(lens, bs, MB, NB, seed=5)
    keep = lambda b, p: (b, p // bs) not in poisoned  # noqa: E731 -- tail rows of a last block are finite
    kv_plane, pe_plane = to_plane(c_kv, table, bs, NB, keep), to_plane(k_pe, table, bs, NB, keep)
    assert torch.isnan(kv_plane).any()
    scale = (dn + dr) ** -0.5
    got = ops.sparse_mla_prefill(q, kv_plane, pe_plane, table, idx, kv_b, scale)
    assert got.shape == (B, T, H, dv) and got.dtype == torch.float64
    assert torch.isfinite(got).all(), "an unselected (NaN) block was read"
    assert torch.equal(got[1, 64:], torch.zeros(T - 64, H, dv, **f64))
    assert torch.equal(got[0, 5], torch.zeros(H, dv, **f64))
    k, v = ops.decompress_kv(c_kv, k_pe, kv_b, H, dn)
    ref = ops.sparse_attention(q, k, v, idx, scale)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------ dispatcher
def test_use_backend_sets_and_restores(monkeypatch):
    monkeypatch.setattr(_dispatch, "_default", "auto")
    with ops.use_backend("torch"):
        assert ops.current_backend() == "torch"
        with ops.use_backend("triton"):
            assert ops.current_backend() == "triton"
        assert ops.current_backend() == "torch"
    assert ops.current_backend() == "auto"
    with pytest.raises(RuntimeError, match="boom"), ops.use_backend("torch"):
        raise RuntimeError("boom")
    assert ops.current_backend() == "auto"
    ops.set_backend("torch")
    assert ops.current_backend() == "torch"


def test_bad_backend_names_are_rejected(monkeypatch):
    monkeypatch.setattr(_dispatch, "_default", "auto")
    with pytest.raises(ValueError, match="'cuda'"):
        ops.set_backend("cuda")
    assert ops.current_backend() == "auto"
    monkeypatch.delitem(_dispatch.TRITON_KERNELS, "store_kv", raising=False)
    with pytest.raises(ValueError, match="store_kv"):
        ops.store_kv(torch.zeros(1, 2, 3), torch.tensor([0]), torch.ones(1, 3), backend="triton")


def test_model_wide_triton_falls_back_per_op_triton_is_strict(monkeypatch):
    """'triton' in force (model.set_backend) runs the references of ops without a kernel; asked of one op
    it is strict. The reference then really runs: its result equals the torch backend's."""
    monkeypatch.delitem(_dispatch.TRITON_KERNELS, "kda_recurrent", raising=False)
    monkeypatch.setattr(_dispatch, "triton_available", lambda: True)
    q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    v, g, beta = torch.randn(1, 2, 1, 3), -torch.rand(1, 2, 1, 4), torch.rand(1, 2, 1)
    with ops.use_backend("triton"):
        got = ops.kda_recurrent(q, k, v, g, beta)
        with pytest.raises(ValueError, match="kda_recurrent has no Triton kernel"):
            ops.kda_recurrent(q, k, v, g, beta, backend="triton")
    want = ops.kda_recurrent(q, k, v, g, beta, backend="torch")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_kernels_are_not_picked_under_autograd(monkeypatch):
    """The kernels have no backward: a call whose inputs require grad runs the reference under a
    model-wide "triton" (so gradients reach the inputs) and is refused when "triton" is asked of the op."""
    module = types.ModuleType("_fake_forward_only_kda")
    module.kda_recurrent = lambda *a, **k: (_ for _ in ()).throw(AssertionError("kernel ran under autograd"))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(_dispatch.TRITON_KERNELS, "kda_recurrent", (module.__name__, "kda_recurrent"))
    monkeypatch.setattr(_dispatch, "triton_available", lambda: True)
    q, k = torch.randn(1, 2, 1, 4, requires_grad=True), torch.randn(1, 2, 1, 4)
    v, g, beta = torch.randn(1, 2, 1, 3), -torch.rand(1, 2, 1, 4), torch.rand(1, 2, 1)
    with ops.use_backend("triton"):
        o, _ = ops.kda_recurrent(q, k, v, g, beta)
        with pytest.raises(ValueError, match="no backward"):
            ops.kda_recurrent(q, k, v, g, beta, backend="triton")
    o.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    with torch.no_grad(), pytest.raises(AssertionError, match="kernel ran"):  # without autograd: the kernel
        ops.kda_recurrent(q, k, v, g, beta, backend="triton")


def _params_from_ast(args: ast.arguments):
    kinds = inspect.Parameter
    positional = [(a, kinds.POSITIONAL_ONLY) for a in args.posonlyargs] + \
                 [(a, kinds.POSITIONAL_OR_KEYWORD) for a in args.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults)) + [((a, kinds.KEYWORD_ONLY), d or inspect.Parameter.empty)
                                               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    extra = [(a, k) for a, k in ((args.vararg, kinds.VAR_POSITIONAL), (args.kwarg, kinds.VAR_KEYWORD)) if a]
    literal = lambda d: d if d is inspect.Parameter.empty else ast.literal_eval(d)  # noqa: E731
    return [(a.arg, k, literal(d)) for (a, k), d in pairs] + [(a.arg, k, inspect.Parameter.empty) for a, k in extra]


def kernel_signature_mismatch(op, parse=None):
    """'' if the kernel registered for ``op`` has its reference's parameters (names, kinds, defaults),
    else a description. Without triton the kernel module is parsed, not imported (importing it would
    need triton); a module already imported is read directly."""
    module, name = _dispatch.TRITON_KERNELS[op]
    if parse is None:
        parse = importlib.util.find_spec("triton") is None and module not in sys.modules
    if parse:
        source = open(importlib.util.find_spec(module).origin).read()
        defs = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
        if not defs:
            return f"{module} defines no function {name}"
        got = _params_from_ast(defs[-1].args)
    else:
        got = [(p.name, p.kind, p.default) for p in inspect.signature(_dispatch.load_kernel(op)).parameters.values()]
    want = [(p.name, p.kind, p.default) for p in inspect.signature(ops.REFERENCES[op]).parameters.values()]
    return "" if got == want else f"{op}: kernel {module}.{name} has {got}, reference has {want}"


@pytest.mark.parametrize("op", sorted(_dispatch.TRITON_KERNELS) or [pytest.param(None, marks=pytest.mark.skip(
    reason="no Triton kernel registered yet; the check itself is exercised by the fake-kernel test"))])
def test_registered_kernels_share_reference_signatures(op):
    assert op in ops.REFERENCES, f"kernel registered for unknown op {op}"
    assert kernel_signature_mismatch(op) == ""


ARGS = "q, k, v, g, beta, scale=None, initial_state=None, chunk_size={}, state_at=None, lengths=None"
MATCHING = f"def kda_chunk({ARGS.format(64)}):\n    pass\n"
DIFFERENT = f"def kda_chunk({ARGS.format(32)}):\n    pass\n"


@pytest.mark.parametrize("how", ["import", "parse"])
def test_signature_check_reports_a_mismatched_kernel(how, monkeypatch, tmp_path):
    for i, (source, ok) in enumerate([(MATCHING, True), (DIFFERENT, False)]):
        name = f"_fake_kda_kernel_{how}_{i}"
        if how == "import":
            module = types.ModuleType(name)
            exec(source, module.__dict__)
            monkeypatch.setitem(sys.modules, name, module)
        else:  # an unimportable file without triton: proves the check parses rather than imports
            (tmp_path / f"{name}.py").write_text("import triton  # noqa\n" + source)
            monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setitem(_dispatch.TRITON_KERNELS, "kda_chunk", (name, "kda_chunk"))
        report = kernel_signature_mismatch("kda_chunk", parse=how == "parse")
        assert (report == "") == ok, report
        if not ok:
            assert "chunk_size" in report and "32" in report
        assert name not in sys.modules or how == "import"
