"""Triton kernels of the routed experts (minidsa/ops/moe_experts/*_triton.py) against their references, on
tiny odd shapes (L = 96, I = 160: neither a power of two nor a multiple of the tiles).

Without a GPU the kernels run in Triton's interpreter with fp32 dots. The conversion must be bit-exact.

MLP tolerance: kernel and reference multiply the same fp32 weight values (both dequantise exactly)
by the same fp32 activations, but add the products in other orders (K tiles of 32, then a tree sum
over slots, against one BLAS call and a sum), and the kernel's tanh/sigmoid are built from exp
(relative error ~1e-7 against torch's). Outputs are O(1) sums of ~100-term dot products, so those
differences are a few fp32 ulps of the terms: 2e-5 absolute and relative covers them, while any
indexing, nibble-order or scale mistake is off by O(0.1). On a GPU the activations enter the tensor
cores as two bf16 halves (~2^-17 relative per product), so 2e-4 there (the one-token GEMV multiplies
in fp32 on the GPU too).
"""

import inspect

import pytest
import torch

pytest.importorskip("triton")

from conftest import kernel_device  # noqa: E402

import minidsa  # noqa: E402
from minidsa.formats import mxfp4  # noqa: E402
from minidsa.ops.moe_experts import convert_triton as convert  # noqa: E402
from minidsa.ops.moe_experts import dequant_triton as dequant  # noqa: E402
from minidsa.ops.moe_experts import lists_triton as lists  # noqa: E402
from minidsa.ops.moe_experts import matvec_triton as matvec  # noqa: E402
from minidsa.ops.moe_experts import mlp_triton as mlp  # noqa: E402
from minidsa.ops.moe_experts import reference as ref  # noqa: E402

DEV = kernel_device()
TOL = dict(atol=2e-5, rtol=2e-5) if DEV == "cpu" else dict(atol=2e-4, rtol=2e-4)
E, L, I = 5, 96, 160
KERNELS = {"mxfp4_to_fp8": convert.mxfp4_to_fp8, "expert_mlp_fp8": mlp.expert_mlp_fp8,
           "expert_mlp_mxfp4": mlp.expert_mlp_mxfp4}


@pytest.mark.parametrize("name", ["mxfp4_to_fp8", "expert_mlp_fp8", "expert_mlp_mxfp4"])
def test_signatures_match_the_references(name):
    assert inspect.signature(KERNELS[name]) == inspect.signature(getattr(ref, name + "_ref"))


@pytest.fixture(scope="module")
def experts_store():
    """MXFP4 storage [E, 3, I*L/2] of random experts; expert 1 is poisoned (0xFF = NaN scales)."""
    g = torch.Generator().manual_seed(0)
    packed, scales = mxfp4.quantize(torch.randn(E, 3, I * L, generator=g) * 0.1)
    scales[1] = 0xFF
    return packed.to(DEV), scales.to(DEV)


def case(store, N, seed=0):
    """z [N, L]; slots -> experts [3, 0, 1, 4] with expert 1 (NaN) an unrouted placeholder; random
    sparse routing with at least one routed token per live slot (slot 3: all); the converted FP8 workspace."""
    packed, scales = store
    g = torch.Generator().manual_seed(seed)
    experts = torch.tensor([3, 0, 1, 4], device=DEV)
    routing = torch.rand(4, N, generator=g) * (torch.rand(4, N, generator=g) < 0.5)
    routing[:, 0] = torch.rand(4, generator=g) + 0.1
    routing[3] = torch.rand(N, generator=g) + 0.1  # every token: at N = 19 its compact list spans two tiles
    routing[2] = 0.0  # the placeholder slot
    z = torch.randn(N, L, generator=g).to(DEV)
    els = torch.empty(5, 3, I * L, dtype=torch.float8_e4m3fn, device=DEV)
    scs = torch.empty(5, 3, I * L // 32, dtype=torch.uint8, device=DEV)
    ref.mxfp4_to_fp8_ref(packed, scales, experts, els, scs)
    return z, experts, routing.to(DEV), els, scs


def live_reference(z, store, experts, routing):
    """The reference over the routed slots only (the placeholder's NaN would poison a dense sum)."""
    keep = torch.tensor([0, 1, 3], device=DEV)
    return ref.expert_mlp_mxfp4_ref(z, *store, experts[keep], routing[keep], 4.0, 25.0)


def test_conversion_is_bit_exact(experts_store):
    packed, scales = experts_store
    experts = torch.tensor([4, 1, 0, 4], device=DEV)  # any order, repeats allowed
    outs = []
    for fn in (convert.mxfp4_to_fp8, ref.mxfp4_to_fp8_ref):
        els = torch.full((6, 3, I * L), 0x5A, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
        scs = torch.full((6, 3, I * L // 32), 0x33, dtype=torch.uint8, device=DEV)
        fn(packed, scales, experts, els, scs)
        outs.append((els.view(torch.uint8), scs))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert (outs[0][0][4:] == 0x5A).all() and (outs[0][1][4:] == 0x33).all()  # slots past n untouched
    # and against mxfp4.to_fp8, the conversion ExpertWorkspace.load uses today
    want, _ = mxfp4.to_fp8(packed[experts].cpu(), scales[experts].cpu())
    assert torch.equal(outs[0][0][:4].cpu(), want.view(torch.uint8))


def test_conversion_of_every_byte_value():
    packed = torch.arange(256, dtype=torch.uint8, device=DEV).view(1, 1, 256)
    scales = torch.arange(16, dtype=torch.uint8, device=DEV).view(1, 1, 16)
    els = torch.empty(1, 1, 512, dtype=torch.float8_e4m3fn, device=DEV)
    scs = torch.empty(1, 1, 16, dtype=torch.uint8, device=DEV)
    convert.mxfp4_to_fp8(packed, scales, torch.tensor([0], device=DEV), els, scs)
    want, _ = mxfp4.to_fp8(packed.cpu(), scales.cpu())
    assert torch.equal(els.view(torch.uint8).cpu(), want.view(torch.uint8)) and torch.equal(scs, scales)


@pytest.mark.parametrize("N,dense", [(1, None), pytest.param(5, None, marks=pytest.mark.slow),
                                     pytest.param(19, None, marks=pytest.mark.slow),
                                     pytest.param(19, False, marks=pytest.mark.slow),
                                     pytest.param(5, False, marks=pytest.mark.slow)],
                         ids=["one-token", "decode", "decode19", "prefill", "compact5"])  # decode19: 40 programs
def test_fp8_and_mxfp4_mlps_match_the_reference(experts_store, N, dense, monkeypatch):
    # N = 5 fits one token tile of the dense pair layout; N = 19 takes two tiles, dense (a decode batch:
    # it must not compact, which reads the pair counts back to the host) or compact (prefill).
    if dense is None:
        monkeypatch.setattr(mlp, "compact_lists", lambda *a: pytest.fail("a decode-sized call synchronised"))
    z, experts, routing, els, scs = case(experts_store, N)
    want = live_reference(z, experts_store, experts, routing)
    got_fp8 = mlp._launch_mlp(z, els, scs, None, routing, 4.0, 25.0, L, I, dense=dense)
    got_mx = mlp._launch_mlp(z, *experts_store, experts, routing, 4.0, 25.0, L, I, dense=dense)
    assert got_fp8.dtype == torch.float32 and torch.isfinite(got_fp8).all(), "the unrouted NaN slot was read"
    torch.testing.assert_close(got_fp8, want, **TOL)
    torch.testing.assert_close(got_mx, want, **TOL)
    # (the tensor-core passes take an MXFP4 tile as its even and odd planes and an FP8 tile whole: the same
    # products, summed in another order, so the two agree to rounding, not bit for bit)
    # (at decode sizes the MXFP4 MLP is a matrix-vector product per routed pair that sums each 32-code
    # group before its scale; the FP8 one scales each product, in a tensor-core pass for several tokens)


@pytest.mark.parametrize("K", [32 * g for g in range(1, 130)])
def test_k_parts_cover_every_group_once(K):
    # The decode kernel cuts K into part A (GA groups), part B (GB groups) and a tail of HC half-group
    # units: each a power of two (a tensor dimension), together at least every group, the tail less than
    # one part-B group past K (padding only there), so that a warp's threads idle on no padding for
    # group counts with at most three set bits (K3's 112 and 96).
    parts = matvec._k_parts(K)
    ga, gb, hc = parts["GA"], parts["GB"], parts["HC"]
    groups = K // 32
    assert ga & (ga - 1) == 0 and gb & (gb - 1) == 0 and hc & (hc - 1) == 0 and ga >= 1
    assert ga + gb <= groups <= ga + gb + hc / 2 and (gb == 0 or gb < ga)
    if bin(groups).count("1") <= 3:
        assert 2 * (ga + gb) + hc == 2 * groups, (groups, parts)


def test_mxfp4_decode_with_a_half_group_tail():
    # I = 224 is 7 scale groups, 4 + 2 + 1: the down pass's third part is 1 group as 2 half-group units
    # (L = 96 is 2 + 1 groups, no tail). Random experts, 3 tokens routed to 2 slots.
    i_tail = 224
    g = torch.Generator().manual_seed(3)
    packed, scales = mxfp4.quantize(torch.randn(2, 3, i_tail * L, generator=g) * 0.1)
    packed, scales = packed.to(DEV), scales.to(DEV)
    assert matvec._k_parts(i_tail) == dict(GA=4, GB=2, HC=2)
    experts = torch.tensor([1, 0], device=DEV)
    routing = (torch.rand(2, 3, generator=g) + 0.1).to(DEV)
    z = torch.randn(3, L, generator=g).to(DEV)
    want = ref.expert_mlp_mxfp4_ref(z, packed, scales, experts, routing, 4.0, 25.0)
    got = mlp._launch_mlp(z, packed, scales, experts, routing, 4.0, 25.0, L, i_tail, dense=True)
    torch.testing.assert_close(got, want, **TOL)


def _bf16_pair(word: int) -> torch.Tensor:
    """A 32-bit word as its two bf16 halves (low half first), fp64."""
    return torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double()


def _run_ptx(text: str, inputs: dict[str, int]) -> dict:
    """Execute straight-line PTX (the E2M1 programs of ``dequant_triton``) on 32-bit inputs {"$8": word, ...};
    returns every register ($j outputs included; a cvt.f32.f16's output holds its fp16 operand's bits).
    Only the opcodes those programs use; a bf16x2 fma is computed in fp64 and must be exact in bf16 (or
    overflow)."""
    regs = dict(inputs, **{"0": 0})
    val = lambda a: regs[a] if a in regs else int(a, 0)
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and "{" in args:  # {lo, hi}, src
            lo, hi, src = [a.strip(" {}") for a in args.replace("}", ",").split(",") if a.strip(" {}")]
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        a = [x.strip() for x in args.split(",")]
        x = [val(v) for v in a[1:]]
        if op in ("mov.b32", "cvt.f32.f16"):
            r = x[0]
        elif op == "shl.b32":
            r = x[0] << x[1]
        elif op == "shr.b32":
            r = x[0] >> x[1]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "prmt.b32":  # byte j = byte (selector nibble j & 7) of {x[1]:x[0]}; nibble bit 3: its sign
            both, r = x[0] | x[1] << 32, 0
            for j in range(4):
                nib = (x[2] >> 4 * j) & 15
                byte = (both >> 8 * (nib & 7)) & 0xFF
                r |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << 8 * j
        elif op == "fma.rn.bf16x2":
            exact = _bf16_pair(x[0]) * _bf16_pair(x[1]) + _bf16_pair(x[2])
            half = exact.to(torch.bfloat16)
            fine = (half.double() == exact) | exact.isnan() | (half.isinf() & (exact.abs() >= 2.0 ** 128 - 2.0 ** 119))
            assert fine.all(), "an inexact product"  # products are exact, or NaN, or past bf16 (and fp32): inf
            bits = half.view(torch.int16).to(torch.int32) & 0xFFFF
            r = int(bits[0]) | int(bits[1]) << 16
        else:
            raise AssertionError(f"opcode {op} not modelled")
        regs[a[0]] = r & 0xFFFFFFFF
    return regs


def _words():
    g = torch.Generator().manual_seed(3)
    return [0x76543210, 0xFEDCBA98, 0x89ABCDEF] + torch.randint(0, 2**31, (40,), generator=g).tolist()


def test_gpu_e2m1_ptx_decodes_every_code():
    # The GPU's matrix-vector path decodes codes with this PTX (the interpreter cannot run it): executed here
    # instruction by instruction, each of eight codes must give the fp16 of its E2M1 value times 2^-14, in
    # element order, for every code in every position.
    values = mxfp4.e2m1_table(torch.float64) * 2.0 ** -14
    for word in _words():
        regs = _run_ptx(dequant.E2M1_PTX.value, {"$8": word})
        got = torch.tensor([regs[f"${j}"] for j in range(8)], dtype=torch.int32).to(torch.int16)
        got = got.view(torch.float16).double()
        want = values[[(word >> 4 * j) & 15 for j in range(8)]]
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), hex(word)


@pytest.mark.parametrize("codes", [(127, 127, 127, 127), (1, 0, 254, 255), (100, 140, 127, 3)],
                         ids=["unit", "extremes", "mixed"])
def test_gpu_e2m1_planes_ptx_decodes_and_scales_every_code(codes):
    # The GPU's tensor-core tiles decode four packed bytes (eight codes, low nibble = even element) with this
    # PTX: outputs $0, $1 the even elements of bytes (0, 1) and (2, 3) as bf16 pairs, $2, $3 the odd ones,
    # each times its byte's E8M0 scale (inputs $5, $6: bf16 pairs). Every code in every position, with
    # scales at the ends of the range (2^-126, 2^127, the NaN code), -0 kept -0.
    # the reference's values: fp32 products (3 * 2^127 is past fp32 as it is past bf16: inf in both)
    values = mxfp4.e2m1_table(torch.float32)
    scale = torch.tensor([2.0 ** (c - 127) if c < 255 else float("nan") for c in codes], dtype=torch.float32)
    sbits = [int(v) & 0xFFFF for v in scale.to(torch.bfloat16).view(torch.int16)]
    assert sbits[0] == codes[0] << 7 or codes[0] in (0, 255)  # what _e8m0_bf16 builds, for its checks below
    for word in _words():
        regs = _run_ptx(dequant._E2M1_PLANES_PTX.value,
                        {"$4": word, "$5": sbits[0] | sbits[1] << 16, "$6": sbits[2] | sbits[3] << 16})
        got = torch.cat([_bf16_pair(regs[f"${j}"]) for j in range(4)]).float()
        nib = [(word >> 4 * j) & 15 for j in range(8)]
        order = (0, 2, 4, 6, 1, 3, 5, 7)  # element j of byte j // 2
        want = values[[nib[j] for j in order]] * scale[[j // 2 for j in order]]
        assert torch.equal(got.isnan(), want.isnan()), hex(word)
        ok = ~want.isnan()
        assert torch.equal(got[ok], want[ok]) and torch.equal(got[ok].signbit(), want[ok].signbit()), hex(word)


def test_e8m0_bf16_is_the_scale_exactly():
    # The tiles' bf16 scales (2^(s-127) for every E8M0 code, NaN for 255), through the interpreter.
    import triton
    import triton.language as tl

    @triton.jit
    def _k(s_ptr, o_ptr):
        i = tl.arange(0, 256)
        tl.store(o_ptr + i, dequant._e8m0_bf16(tl.load(s_ptr + i)))

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEV)
    out = torch.empty(256, dtype=torch.bfloat16, device=DEV)
    _k[(1,)](codes, out)
    want = torch.tensor([2.0 ** (c - 127) for c in range(255)] + [float("nan")], dtype=torch.float64)
    assert torch.equal(out[:255].double().cpu(), want[:255]) and out[255].isnan()


@pytest.mark.slow  # seconds in the interpreter; the GPU run compiles it
def test_bf16_z_is_read_as_it_is(experts_store):
    # A bf16 model's z goes to the kernels unconverted; its values are exact in bf16, so the up pass's single
    # bf16 product gives exactly what the fp32 copy's two give (the low halves are zero).
    z, experts, routing, _, _ = case(experts_store, 5, seed=2)
    zb = z.to(torch.bfloat16)
    got = mlp._launch_mlp(zb, *experts_store, experts, routing, 4.0, 25.0, L, I)
    assert torch.equal(got, mlp._launch_mlp(zb.float(), *experts_store, experts, routing, 4.0, 25.0, L, I))
    one = mlp._launch_mlp(zb[:1], *experts_store, experts, routing[:, :1], 4.0, 25.0, L, I)  # matrix-vector path
    assert torch.equal(one, mlp._launch_mlp(zb[:1].float(), *experts_store, experts, routing[:, :1], 4.0, 25.0, L, I))


def test_public_kernels_and_unrouted_tokens(experts_store):
    # A token routed nowhere gets exactly 0; the public entry points pick the layout themselves.
    z, experts, routing, els, scs = case(experts_store, 4, seed=1)
    routing[:, 2] = 0.0
    got = mlp.expert_mlp_mxfp4(z, *experts_store, experts, routing, 4.0, 25.0)
    assert torch.equal(got[2], torch.zeros(L, device=DEV))
    torch.testing.assert_close(got, live_reference(z, experts_store, experts, routing), **TOL)
    got_fp8 = mlp.expert_mlp_fp8(z, els, scs, routing, 4.0, 25.0)
    assert torch.equal(got_fp8[2], torch.zeros(L, device=DEV))
    torch.testing.assert_close(got_fp8, got, **TOL)


@pytest.mark.parametrize("N", [2, pytest.param(20, marks=pytest.mark.slow)])  # matrix-vector and tensor-core paths
def test_kernels_are_deterministic(experts_store, N, monkeypatch):
    monkeypatch.setattr(mlp, "DENSE_MAX_TOKENS", 16)  # 20 tokens take the compact (prefill) layout, two tiles
    z, experts, routing, els, scs = case(experts_store, N, seed=2)
    a = mlp.expert_mlp_mxfp4(z, *experts_store, experts, routing, 4.0, 25.0)
    b = mlp.expert_mlp_mxfp4(z, *experts_store, experts, routing, 4.0, 25.0)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_kernel_reproduces_the_tiny_layer():
    model = minidsa.load("tiny")
    moe = model.moe_layers()[2]
    x = torch.randn(3, model.config.hidden_size)
    seen = []
    hook = moe.routed_expert_norm.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
    with torch.no_grad():
        moe(x)
        hook.remove()
        ids, weights = moe.route(x)
        z = moe.routed_expert_down_proj(x)
        experts, _, _ = moe.experts.plan(ids, weights)
        routing = ((ids.unsqueeze(0) == experts.view(-1, 1, 1)) * weights).sum(-1)
    on = lambda t: t.to(DEV)  # noqa: E731
    got = mlp.expert_mlp_mxfp4(on(z), on(moe.experts.packed), on(moe.experts.scales), on(experts), on(routing),
                               moe.experts.beta_gate, moe.experts.beta_up)
    torch.testing.assert_close(got.cpu(), seen[0], **TOL)


def test_bad_inputs_raise_like_the_reference(experts_store):
    z, experts, routing, els, scs = case(experts_store, 3)
    packed, scales = experts_store
    calls = [
        ("expert_mlp_fp8", (z[:, :40], els, scs, routing, 4.0, 25.0)),
        ("expert_mlp_fp8", (z, els.view(torch.uint8), scs, routing, 4.0, 25.0)),
        ("expert_mlp_fp8", (z, els, scs, torch.zeros(6, 3, device=DEV), 4.0, 25.0)),
        ("expert_mlp_mxfp4", (z, packed, scales, experts[:3], routing, 4.0, 25.0)),
        ("expert_mlp_mxfp4", (z, packed, scales[:, :2], experts, routing, 4.0, 25.0)),
        ("mxfp4_to_fp8", (packed, scales, experts.float(), els, scs)),
        ("mxfp4_to_fp8", (packed, scales, torch.arange(5, device=DEV).repeat(2), els, scs)),
    ]
    for name, args in calls:
        with pytest.raises((TypeError, ValueError)) as want:
            getattr(ref, name + "_ref")(*args)
        with pytest.raises(want.type, match=str(want.value).replace("(", r"\(").replace(")", r"\)")):
            KERNELS[name](*args)
    with pytest.raises(ValueError, match="contiguous"):
        mlp.expert_mlp_mxfp4(z, packed.transpose(0, 1).contiguous().transpose(0, 1), scales, experts, routing,
                             4.0, 25.0)  # matrices of one expert not adjacent


def test_fp64_goes_to_the_reference(experts_store):
    z, experts, routing, els, scs = case(experts_store, 2)
    z64, g64 = z.double(), routing.double()
    keep = torch.tensor([0, 1, 3], device=DEV)
    got = mlp.expert_mlp_fp8(z64, els[keep], scs[keep], g64[keep], 4.0, 25.0)
    assert got.dtype == torch.float64
    assert torch.equal(got, ref.expert_mlp_fp8_ref(z64, els[keep], scs[keep], g64[keep], 4.0, 25.0))


def test_a_pair_bound_sizes_the_compact_layout_without_reading_back(experts_store, monkeypatch):
    """With max_pairs (a MoE layer passes N * top_k) the prefill layout reads nothing back to the host and gives
    the counted layout's result bit for bit; a bound below the real count is refused, not overrun."""
    z, experts, routing, els, scs = case(experts_store, 5)
    counted = mlp._launch_mlp(z, els, scs, None, routing, 4.0, 25.0, L, I, dense=False)
    pairs = int((routing != 0).sum())
    monkeypatch.setattr(torch.Tensor, "tolist", lambda *a: pytest.fail("the pair count was read back"))
    bounded = mlp._launch_mlp(z, els, scs, None, routing, 4.0, 25.0, L, I, dense=False, max_pairs=pairs + 7)
    assert torch.equal(bounded, counted)
    if DEV == "cpu":  # on a GPU the assertion stops the device for good: the process (this test run) is over
        with pytest.raises(RuntimeError, match="more routed pairs than max_pairs"):
            mlp._launch_mlp(z, els, scs, None, routing, 4.0, 25.0, L, I, dense=False, max_pairs=pairs - 1)


def test_the_tile_list_walks_each_slots_tokens_once(experts_store):
    """The compact layout's grid is one list of token tiles, slot by slot: an empty slot first, a slot of two
    tiles, the placeholder (none), a slot of one; the grid holds a bound on the list, and programs past its end
    do nothing. The MLP over it equals the reference."""
    N = 19
    z, experts, routing, els, scs = case(experts_store, N, seed=3)
    routing[0] = 0.0
    routing[1] = torch.rand(N, device=DEV) + 0.1  # every token: two tiles of 16 (the interpreter's BLOCK_T)
    routing[3] = 0.0
    routing[3, [2, 7, 18]] = 0.5
    block_t = mlp._config(DEV != "cpu", False)["BLOCK_T"]
    *_, tile_end, pairs, tiles = lists.compact_lists(routing, block_t)
    per_slot = [0, -(-N // block_t), 0, 1]
    assert tile_end.tolist() == [sum(per_slot[:j + 1]) for j in range(4)] and pairs == N + 3
    assert sum(per_slot) <= tiles <= -(-pairs // block_t) + 4
    got = mlp._launch_mlp(z, els, scs, None, routing, 4.0, 25.0, L, I, dense=False)
    torch.testing.assert_close(got, live_reference(z, experts_store, experts, routing), **TOL)


@pytest.mark.parametrize("m,N,density", [(4, 19, 0.5), (5, 70, 0.3), (64, 300, 8 / 64), (3, 33, 0.0)])
def test_the_lists_are_the_torch_expressions(m, N, density):
    """The three list-building launches against the expressions they replace: ranks (inclusive running counts per
    slot), counts, offsets, the tile list's ends and every routed token at its place in its slot's list."""
    g = torch.Generator().manual_seed(m + N)
    routing = (torch.rand(m, N, generator=g) * (torch.rand(m, N, generator=g) < density)).to(DEV)
    rank, count, offset, token, tile_end, pairs, tiles = lists.compact_lists(routing, 16)
    routed = (routing != 0).cpu()
    want_rank = torch.cumsum(routed, 1, dtype=torch.int32)
    want_count = want_rank[:, -1]
    want_offset = torch.cumsum(want_count, 0, dtype=torch.int32) - want_count
    assert torch.equal(rank.cpu(), want_rank) and torch.equal(count.cpu(), want_count)
    assert torch.equal(offset.cpu(), want_offset) and pairs == int(routed.sum())
    assert tile_end.tolist() == torch.cumsum((want_count + 15) // 16, 0).tolist()
    for j in range(m):
        listed = token[int(want_offset[j]): int(want_offset[j]) + int(want_count[j])].cpu()
        assert listed.tolist() == routed[j].nonzero().view(-1).tolist()
