"""Triton indexer kernels (minidsa/ops/indexer/scores_triton.py) against their references, on tiny odd shapes.

Without a GPU the kernels run in Triton's interpreter, in fp32 (its tl.dot on bf16 is garbage:
docs/design.md §10, trap 9). Every plane byte the kernel must not read holds NaN, so a stray read
shows up as a non-finite score.

Tolerances: both sides compute fp32 products of the same values and add them in fp32, in different
orders (the kernel's dot blocks D and sums heads in its own order; einsum in another). For O(1)
inputs and D <= 64 the scores are O(10) and the order differences are a few ulps of that: 1e-5
absolute and relative covers it with room, while any indexing mistake is off by O(1).
"""

import inspect

import pytest
import torch

pytest.importorskip("triton")

from conftest import kernel_device  # noqa: E402

from minidsa.formats.fp8 import quantize_fp8_pow2  # noqa: E402
from minidsa.ops.indexer import reference as ref_ops  # noqa: E402
from minidsa.ops.indexer import scores_triton as kern  # noqa: E402
from minidsa.ops.indexer import topk_triton  # noqa: E402

DEV = kernel_device()
NAN, INF = float("nan"), float("inf")
# bf16 runs only on the GPU. Kernel and reference then see the same bf16 values, whose products are
# exact in fp32; the tensor cores add them in their own order and internal width, so allow ~1e-3.
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("name", ["paged_index_scores", "index_scores", "topk_indices"])
def test_signatures_match_the_references(name):
    module = topk_triton if name == "topk_indices" else kern
    assert inspect.signature(getattr(module, name)) == inspect.signature(getattr(ref_ops, name + "_ref"))


def paged_case(B, T, H, D, bs, MB, lens, dtype, fp8, seed=0):
    """Random q, w and a paged key plane: physical blocks in a shuffled order, -1 past each row's
    blocks, and NaN in every unowned block and every slot past a row's context length."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    NB = sum(need) + 2  # two blocks nobody owns
    perm = torch.randperm(NB, generator=g).tolist()
    table = torch.full((B, MB), -1, dtype=torch.int32)
    plane = torch.full((NB, bs, D), NAN)
    kscale = torch.full((NB, bs, 1), NAN)
    for b, n in enumerate(lens):
        for j in range(need[b]):
            table[b, j] = perm.pop()
        for p in range(n):
            key = torch.randn(1, D, generator=g)
            if fp8:  # keep the quantised pair, so both sides see exactly the same key
                v, s = quantize_fp8_pow2(key)
                key, kscale[table[b, p // bs], p % bs] = v.float(), s
            plane[table[b, p // bs], p % bs] = key
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    w = torch.randn(B, T, H, generator=g)
    plane = plane.to(torch.float8_e4m3fn if fp8 else dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    on = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return on(q), on(w), on(plane), on(kscale) if fp8 else None, on(table), on(ctx)


def check_scores(got, args, dtype):
    q, w, plane, kscale, table, ctx = args
    want = ref_ops.paged_index_scores_ref(*args, q.shape[-1] ** -0.5)
    assert got.dtype == torch.float32 and got.shape == want.shape
    for b, n in enumerate(ctx.tolist()):
        assert torch.isfinite(got[b, :, :n]).all(), "a NaN plane byte outside the sequence was read"
        assert (got[b, :, n:] == -INF).all()
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("T,H", [(1, 3), (5, 5)], ids=["decode", "prefill"])
def test_paged_scores_match_reference(T, H, fp8, dtype):
    # D = 60 (not a power of two), block size 4, per-row lengths that end mid-block, a short row.
    args = paged_case(B=3, T=T, H=H, D=60, bs=4, MB=6, lens=[21, 9, 1], dtype=dtype, fp8=fp8)
    check_scores(kern.paged_index_scores(*args, 60 ** -0.5), args, dtype)


def test_paged_scores_several_query_tiles_and_key_chunks():
    # T = 19 over query tiles of 16 on the CPU (H = 5 pads to 8 rows a query): the second tile is
    # mostly padding. Key chunks of one key tile each split the rows across programs; row 1's context
    # ends inside chunk 0, so its later chunks only write -inf.
    block_n = kern._tile_config(19, 5, DEV == "cuda")[2]
    MB = -(-5 * block_n // 8)  # 2.5 key tiles of blocks of 4
    args = paged_case(B=2, T=19, H=5, D=32, bs=4, MB=MB, lens=[4 * MB - 3, 6], dtype=torch.float32, fp8=False)
    got = kern._launch_scores(*args, 32 ** -0.5, keys_per_program=block_n)
    check_scores(got, args, torch.float32)


def test_paged_scores_causal_bound_skips_later_keys():
    # Prefill queries with their positions: row 0 the last 19 of its 4*MB-3 keys, row 1 a 3-token piece
    # ending at its context's end and then padding (-1, a whole row of -inf). Key chunks of one tile each,
    # so whole tiles after every query of a query tile are skipped, and the tile on the diagonal is cut
    # per query. The unbounded scores are the reference's wherever the bound keeps them.
    block_n = kern._tile_config(19, 5, DEV == "cuda")[2]
    MB = -(-5 * block_n // 8)
    args = paged_case(B=2, T=19, H=5, D=32, bs=4, MB=MB, lens=[4 * MB - 3, 6], dtype=torch.float32, fp8=False)
    n0 = 4 * MB - 3
    q_pos = torch.stack([torch.arange(n0 - 19, n0), torch.tensor([3, 4, 5] + [-1] * 16)]).to(DEV)
    got = kern._launch_scores(*args, 32 ** -0.5, q_pos, keys_per_program=block_n)
    want = ref_ops.paged_index_scores_ref(*args, 32 ** -0.5, q_pos)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    later = torch.arange(got.shape[-1], device=DEV).view(1, 1, -1) > q_pos.unsqueeze(-1)
    assert (got[later] == -INF).all() and torch.isfinite(got[~later & (got > -INF)]).all()
    assert (want[1, 3:] == -INF).all()


def test_paged_scores_position_without_block_inside_context_is_minus_inf():
    # A -1 entry inside the context is never loaded and, like a position past the context, scores
    # -inf (in the reference too), so top-k can never select a position that has no memory behind it.
    q, w, plane, _, table, ctx = paged_case(B=1, T=2, H=3, D=16, bs=4, MB=3, lens=[12], dtype=torch.float32,
                                            fp8=False)
    table[0, 1] = -1
    got = kern.paged_index_scores(q, w, plane, None, table, ctx, 0.25)
    assert torch.equal(got[0, :, 4:8], torch.full((2, 4), float("-inf"), device=DEV))
    assert torch.isfinite(got[0, :, :4]).all() and torch.isfinite(got[0, :, 8:12]).all()
    want = ref_ops.paged_index_scores_ref(q, w, plane, None, table, ctx, 0.25)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_index_scores_match_reference(dtype):
    q = torch.randn(2, 3, 5, 60, device=DEV).to(dtype)
    k = torch.randn(2, 11, 60, device=DEV).to(dtype)
    w = torch.randn(2, 3, 5, device=DEV)
    got = kern.index_scores(q, k, w, 0.13)
    torch.testing.assert_close(got, ref_ops.index_scores_ref(q, k, w, 0.13), **TOL[dtype])


def test_fp64_inputs_keep_the_reference_contract():
    q, k, w = torch.randn(1, 2, 3, 8, dtype=torch.float64), torch.randn(1, 5, 8, dtype=torch.float64), \
        torch.randn(1, 2, 3, dtype=torch.float64)
    assert torch.equal(kern.index_scores(q, k, w, 0.3), ref_ops.index_scores_ref(q, k, w, 0.3))


def test_bad_input_raises_like_the_reference():
    q, w, plane, kscale, table, ctx = paged_case(B=1, T=1, H=2, D=16, bs=4, MB=2, lens=[5], dtype=torch.float32,
                                                 fp8=True)
    bad_calls = [
        (q[0], w, plane, kscale, table, ctx), (q, w[..., :1], plane, kscale, table, ctx),
        (q, w, plane[..., :8], kscale, table, ctx), (q, w, plane, kscale[:, :2], table, ctx),
        (q, w, plane, kscale, table.float(), ctx), (q, w, plane, kscale, table, ctx.view(1, 1)),
        (q.int(), w, plane, kscale, table, ctx),
    ]
    for args in bad_calls:
        with pytest.raises((TypeError, ValueError)) as want:
            ref_ops.paged_index_scores_ref(*args, 0.25)
        with pytest.raises(want.type, match=str(want.value).replace("(", r"\(").replace(")", r"\)")):
            kern.paged_index_scores(*args, 0.25)
    scores, pos = torch.randn(1, 2, 4), torch.zeros(1, 2, dtype=torch.long)
    for args in [(scores, 0, pos), (scores, True, pos), (scores, 2, pos.float()), (scores[0], 2, pos),
                 (torch.full((1, 2, 4), NAN), 2, pos)]:
        with pytest.raises((TypeError, ValueError)) as want:
            ref_ops.topk_indices_ref(*args)
        with pytest.raises(want.type):
            topk_triton.topk_indices(*args)


# ------------------------------------------------------------------ top-k
@pytest.fixture(params=["radix", "row-sort"])
def topk_path(request, monkeypatch):
    """Every top-k test runs both kernel paths: the multi-program radix select (forced by a zero
    short-row limit) and the whole-row sort that rows of at most 2,048 positions take."""
    monkeypatch.setattr(topk_triton, "_ROW_SORT_MAX_S", 0 if request.param == "radix" else 1 << 30)
    return request.param


@pytest.mark.parametrize("S,topk", [(37, 8), (37, 40), (5, 5), (1, 3)])
def test_topk_matches_reference(S, topk, topk_path):
    scores = torch.randn(2, 4, S, device=DEV)
    q_pos = torch.tensor([[0, 3, S - 1, S + 5], [-1, 1, S // 2, 2]], device=DEV)
    assert torch.equal(topk_triton.topk_indices(scores, topk, q_pos), ref_ops.topk_indices_ref(scores, topk, q_pos))


@pytest.fixture
def radix_path(monkeypatch):
    """The multi-program radix select alone (the whole-row sort has no blocks for ties to straddle)."""
    monkeypatch.setattr(topk_triton, "_ROW_SORT_MAX_S", 0)


@pytest.mark.parametrize("levels", [pytest.param(3, marks=pytest.mark.slow), pytest.param(1000, marks=pytest.mark.slow),
                                    None])  # one case in the quick set: each is seconds in the interpreter
def test_topk_radix_select_with_ties_across_blocks(levels, radix_path):
    # S spans several interpreter blocks (64) so the threshold's ties fall in more than one of them;
    # few distinct levels put the k-th key inside a long run of equal scores, None keeps them distinct.
    g = torch.Generator().manual_seed(levels or 0)
    scores = torch.randn(2, 3, 201, generator=g)
    if levels is not None:
        scores = torch.randint(-levels, levels, (2, 3, 201), generator=g).float() * 0.125
    scores[0, 0, 50:60] = -INF
    q_pos = torch.tensor([[200, 150, 60], [199, 64, 40]])
    scores, q_pos = scores.to(DEV), q_pos.to(DEV)
    for k in (37, 150):
        assert torch.equal(topk_triton.topk_indices(scores, k, q_pos), ref_ops.topk_indices_ref(scores, k, q_pos)), k


@pytest.mark.parametrize("kind", ["clustered"] + [pytest.param(k, marks=pytest.mark.slow)
                                              for k in ("equal", "spread", "mixed-sign")])
def test_topk_on_hard_score_distributions(kind, topk_path):
    # "clustered": values 1 + tiny offsets (many differ only in their last bits), "equal": one tied
    # value everywhere (positions decide), "spread": many binades, "mixed-sign": zero, -0.0 and -inf.
    g = torch.Generator().manual_seed(7)
    S = 300 if topk_path == "radix" else 100  # the row sort is one program per row: its cost grows with S
    if kind == "clustered":
        scores = 1.0 + torch.randint(0, 40, (2, 2, S), generator=g).float() * 2.0 ** -20
    elif kind == "equal":
        scores = torch.full((2, 2, S), 0.75)
    elif kind == "spread":
        scores = torch.randn(2, 2, S, generator=g) * torch.exp2(torch.randint(-60, 60, (2, 2, S), generator=g).float())
    else:
        scores = torch.randn(2, 2, S, generator=g)
        scores[..., ::7] = -INF
        scores[..., ::11] = -0.0
    q_pos = torch.tensor([[S - 1, S // 2], [-1, 4]])
    scores, q_pos = scores.to(DEV), q_pos.to(DEV)
    # S = 300 spans five interpreter tiles (64), so every radix pass merges histograms across programs and
    # the ties at the threshold straddle tiles; rows resolve at different passes (q_pos = 4: at once).
    for k in (5, 64):
        got = topk_triton.topk_indices(scores, k, q_pos)
        assert torch.equal(got, ref_ops.topk_indices_ref(scores, k, q_pos)), k


def test_topk_ties_go_to_the_lower_position(topk_path):
    # Exact ties everywhere: 0.5 at 3 and 9, -0.0 and +0.0 (equal scores) at 1, 4, 6, -inf candidates.
    s = torch.tensor([-1.0, -0.0, -2.0, 0.5, 0.0, -INF, 0.0, -1.0, -INF, 0.5, 2.0, 2.0], device=DEV)
    q_pos = torch.tensor([[10, 11, 8]], device=DEV)
    got = topk_triton.topk_indices(s.view(1, 1, -1).expand(1, 3, -1), 12, q_pos)
    assert got[0, 0].tolist() == [10, 3, 9, 1, 4, 6, 0, 7, 2, 5, 8, -1]
    assert got[0, 1].tolist() == [10, 11, 3, 9, 1, 4, 6, 0, 7, 2, 5, 8]
    assert got[0, 2].tolist() == [3, 1, 4, 6, 0, 7, 2, 5, 8, -1, -1, -1]
    assert torch.equal(got, ref_ops.topk_indices_ref(s.view(1, 1, -1).expand(1, 3, -1), 12, q_pos))


def test_topk_pads_with_minus_one_never_future(topk_path):
    scores = torch.arange(10.0, device=DEV).view(1, 1, 10)  # the future scores best
    got = topk_triton.topk_indices(scores, 6, torch.tensor([[2]], device=DEV))
    assert got.tolist() == [[[2, 1, 0, -1, -1, -1]]] and got.dtype == torch.int32


def test_topk_over_kernel_scores_with_minus_inf_context_padding(topk_path):
    args = paged_case(B=2, T=3, H=3, D=16, bs=4, MB=4, lens=[14, 6], dtype=torch.float32, fp8=False)
    scores = kern.paged_index_scores(*args, 0.25)
    q_pos = torch.tensor([[11, 12, 13], [3, 4, 5]], device=DEV)
    assert torch.equal(topk_triton.topk_indices(scores, 9, q_pos), ref_ops.topk_indices_ref(scores, 9, q_pos))


def test_kernels_are_deterministic(topk_path):
    args = paged_case(B=2, T=3, H=5, D=60, bs=4, MB=5, lens=[19, 7], dtype=torch.float32, fp8=True)
    a, b = kern.paged_index_scores(*args, 0.1), kern.paged_index_scores(*args, 0.1)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    q_pos = torch.tensor([[10, 15, 18], [4, 5, 6]], device=DEV)
    assert torch.equal(topk_triton.topk_indices(a, 7, q_pos), topk_triton.topk_indices(b, 7, q_pos))
