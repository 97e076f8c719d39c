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


def _expert_inputs(gen, E=5, m=4, N=11, L=64, I=96, dtype=torch.float32):
    """Random MXFP4 experts (every code and scales around 2^0), a workspace of m slots, z [N, L], routing [m, N]
    with most pairs unrouted as top-k routing leaves them (so the routed-rows path runs at N >= 8)."""
    packed = torch.randint(0, 256, (E, 3, I * L // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(124, 130, (E, 3, I * L // 32), generator=gen, dtype=torch.uint8)
    experts = torch.tensor([3, 0, 4, 1][:m])
    z = torch.randn(N, L, generator=gen, dtype=dtype)
    routing = torch.rand(m, N, generator=gen, dtype=dtype) * (torch.rand(m, N, generator=gen) < 0.3)
    return packed, scales, experts, z, routing


def test_moe_cpu_forms_equal_the_references():
    """Conversion byte for byte; the MLPs to the rounding of a different order of the same fp32 sums (the
    routed rows add per expert through index_add; matmuls of other shapes block K differently): 1e-5 relative
    to outputs of about 10-50 is a few ulps of their size. In fp64 the same gap is 1e-12."""
    from minidsa.ops.moe_experts import cpu
    from minidsa.ops.moe_experts import reference as ref

    gen = torch.Generator().manual_seed(7)
    packed, scales, experts, z, routing = _expert_inputs(gen)
    els = [torch.zeros(6, 3, packed.shape[-1] * 2, dtype=torch.float8_e4m3fn) for _ in range(2)]
    scs = [torch.zeros(6, 3, scales.shape[-1], dtype=torch.uint8) for _ in range(2)]
    ref.mxfp4_to_fp8_ref(packed, scales, experts, els[0], scs[0])
    cpu.mxfp4_to_fp8(packed, scales, experts, els[1], scs[1])
    assert torch.equal(els[0].view(torch.uint8), els[1].view(torch.uint8)) and torch.equal(scs[0], scs[1])
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        zz, gg = z.to(dtype), routing.to(dtype)
        want = ref.expert_mlp_mxfp4_ref(zz, packed, scales, experts, gg, 4.0, 25.0)
        torch.testing.assert_close(cpu.expert_mlp_mxfp4(zz, packed, scales, experts, gg, 4.0, 25.0), want,
                                   rtol=tol, atol=tol * want.abs().max().item())
        fp8 = ref.expert_mlp_fp8_ref(zz, els[0], scs[0], gg, 4.0, 25.0)
        torch.testing.assert_close(cpu.expert_mlp_fp8(zz, els[0], scs[0], gg, 4.0, 25.0), fp8,
                                   rtol=tol, atol=tol * want.abs().max().item())
        torch.testing.assert_close(fp8, want, rtol=tol, atol=tol * want.abs().max().item())
    for op in ("mxfp4_to_fp8", "expert_mlp_fp8", "expert_mlp_mxfp4"):
        assert pick(op, "auto", ops.REFERENCES[op], z) is getattr(cpu, op)
        assert pick(op, "torch", ops.REFERENCES[op], z) is ops.REFERENCES[op]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float64, 1e-12)])
def test_kda_chunk_cpu_form_equals_the_reference(dtype, tol):
    """Odd shapes (T = 63 with chunks of 16, GQA 2 -> 4 value heads, K = 12, V = 20), a padded row, an initial
    state and kept states: the factored sums and the skipped padding give the reference's outputs to the
    rounding of differently ordered sums (fp32: 2e-5 of outputs of order 1 is a few hundred ulps of the
    sums' terms, which reach about 10 here; fp64: 1e-12)."""
    from minidsa.ops.kda import chunk_cpu
    from minidsa.ops.kda.reference import kda_chunk_ref

    gen = torch.Generator().manual_seed(5)
    B, T, H, HV, K, V = 3, 63, 2, 4, 12, 20
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1) for _ in "qk")
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    g = -5.0 * torch.rand(B, T, HV, K, generator=gen, dtype=dtype)  # the model's decay floor is -5
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    s0 = torch.randn(B, HV, K, V, generator=gen, dtype=dtype)
    lengths = torch.tensor([63, 20, 48])
    state_at = torch.tensor([[0, 16], [1, 0], [2, 48], [-1, 0], [0, 63]])
    want = kda_chunk_ref(q, k, v, g, beta, None, s0, 16, state_at, lengths)
    got = chunk_cpu.kda_chunk(q, k, v, g, beta, None, s0, 16, state_at, lengths)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert pick("kda_chunk", "auto", kda_chunk_ref, q) is chunk_cpu.kda_chunk


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 4e-6), (torch.float64, 1e-12)])
def test_paged_scores_cpu_form_equals_the_reference(dtype, tol):
    """Odd shapes (T = 13, D = 20, blocks of 4), the table out of order with -1 past each row's blocks, NaN keys
    in blocks nobody owns, fp8 keys with scales, prefill rows padded with -1, a decode step and no bound.
    The form multiplies only live queries and keys: the same sums of D products, but BLAS may order a smaller
    product's sums differently (MKL's AVX-512 path does), so a few units in the last place apart; -inf at
    exactly the same places."""
    from minidsa.ops.indexer import scores_cpu
    from minidsa.ops.indexer.reference import paged_index_scores_ref

    g = torch.Generator().manual_seed(3)
    B, T, H, D, bs = 3, 13, 3, 20, 4  # 7 blocks a row
    table = torch.tensor([[9, 2, 5, 0, -1, -1, -1], [7, 1, 4, 8, 3, 10, -1], [6, -1, -1, -1, -1, -1, -1]])
    ctx = torch.tensor([14, 22, 3])
    plane = torch.randn(12, bs, D, generator=g)
    plane[11] = float("nan")  # nobody's block
    for fp8 in (False, True):
        kp = plane.to(torch.float8_e4m3fn) if fp8 else plane.to(dtype)
        ks = torch.rand(12, bs, 1, generator=g) + 0.5 if fp8 else None
        q = torch.randn(B, T, H, D, generator=g, dtype=dtype)
        w = torch.randn(B, T, H, generator=g, dtype=dtype)
        q_pos = torch.stack([torch.arange(1, 14), torch.arange(9, 22), torch.tensor([0, 1, 2] + [-1] * 10)])
        for qp, rows in ((q_pos, T), (ctx.view(B, 1) - 1, 1), (None, T)):
            args = (q[:, :rows], w[:, :rows], kp, ks, table, ctx, D ** -0.5, qp)
            got, want = scores_cpu.paged_index_scores(*args), paged_index_scores_ref(*args)
            assert torch.equal(got == -INF, want == -INF)
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert pick("paged_index_scores", "auto", paged_index_scores_ref, q) is scores_cpu.paged_index_scores


def test_references_are_plain():
    """A reference.py is the formula: no host reads of tensor values, no device tests, no cached tables (those
    belong to the CPU forms, the kernels and the checks modules)."""
    import pathlib
    import re

    forbidden = re.compile(r"on_host\(|lru_cache|\.tolist\(\)|\.item\(\)|device\.type|is_cuda|65536")
    bad = []
    for path in (pathlib.Path(ops.__file__).parent).glob("*/reference.py"):
        bad += [f"{path.parent.name}/reference.py:{i}: {line.strip()}"
                for i, line in enumerate(path.read_text().splitlines(), 1) if forbidden.search(line)]
    assert not bad, "\n".join(bad)


def test_cpu_forms_carry_gradients_like_the_references():
    """"auto" runs the CPU forms under autograd too (training on a CPU): their gradients are the references'
    (fp64, so only the order of sums differs: 1e-10 relative). An unrouted (zero) gate is a constant of the
    layer, not a weight: the routed rows give it no gradient, the dense reference does; only routed ones are
    compared."""
    from minidsa.ops.kda import chunk_cpu
    from minidsa.ops.kda.reference import kda_chunk_ref
    from minidsa.ops.moe_experts import cpu
    from minidsa.ops.moe_experts import reference as ref

    gen = torch.Generator().manual_seed(9)
    B, T, H, K, V = 2, 40, 2, 8, 8
    inputs = [torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
              for _ in "qk"]
    inputs += [torch.randn(B, T, H, V, generator=gen, dtype=torch.float64),
               -3.0 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64),
               torch.rand(B, T, H, generator=gen, dtype=torch.float64)]
    packed, scales, experts, z, routing = _expert_inputs(gen, N=12, dtype=torch.float64)
    cases = [(kda_chunk_ref, chunk_cpu.kda_chunk, inputs, lambda f, x: f(*x, chunk_size=16)[0]),
             (ref.expert_mlp_mxfp4_ref, cpu.expert_mlp_mxfp4, [z, routing],
              lambda f, x: f(x[0], packed, scales, experts, x[1], 4.0, 25.0))]
    for reference, form, xs, call in cases:
        grads = []
        for f in (reference, form):
            leaves = [x.clone().requires_grad_() for x in xs]
            call(f, leaves).pow(2).sum().backward()
            grads.append([leaf.grad for leaf in leaves])
        for x, a, b in zip(xs, *grads):
            keep = (x != 0) if x is routing else torch.ones_like(x, dtype=torch.bool)
            torch.testing.assert_close(a[keep], b[keep], rtol=1e-10, atol=1e-10 * a.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_products_equal_a_product_per_slot(dtype):
    """The routed rows' products per slot in one grouped call (fp32; fp64 takes the loop): the same values as one
    product per slot, bit for bit, with empty slots first, inside and last and odd sizes (K 60, R 36)."""
    from minidsa.ops.moe_experts import cpu
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([0, 3, 0, 7, 1, 0, 13, 0])
    x = torch.randn(int(counts.sum()), 60, generator=g, dtype=dtype)
    w = torch.randn(8, 36, 60, generator=g, dtype=dtype)
    want = torch.cat([part @ w[j].mT for j, part in enumerate(x.split(counts.tolist())) if part.shape[0]])
    assert torch.equal(cpu.grouped_products(x, w, counts), want)


def test_grouped_products_fall_back_once_where_grouped_mm_has_no_cpu_kernel(monkeypatch):
    """A torch whose grouped_mm raises on CPU tensors: the per-slot products give the values, and grouped_mm is
    not asked again."""
    from minidsa.ops.moe_experts import cpu
    calls = []

    def missing(*args, **kwargs):
        calls.append(1)
        raise NotImplementedError("grouped_mm: no CPU kernel")
    monkeypatch.setattr(cpu, "GROUPED_MM", missing)
    counts = torch.tensor([2, 0, 3])
    x, w = torch.randn(5, 8), torch.randn(3, 4, 8)
    want = torch.cat([x[:2] @ w[0].mT, x[2:] @ w[2].mT])
    assert torch.equal(cpu.grouped_products(x, w, counts), want)
    assert torch.equal(cpu.grouped_products(x, w, counts), want)
    assert calls == [1] and cpu.GROUPED_MM is None
