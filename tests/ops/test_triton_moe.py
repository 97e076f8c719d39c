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
    sparse gates with at least one routed token per live slot (slot 3: all); the converted FP8 workspace."""
    packed, scales = store
    g = torch.Generator().manual_seed(seed)
    experts = torch.tensor([3, 0, 1, 4], device=DEV)
    gates = torch.rand(4, N, generator=g) * (torch.rand(4, N, generator=g) < 0.5)
    gates[:, 0] = torch.rand(4, generator=g) + 0.1
    gates[3] = torch.rand(N, generator=g) + 0.1  # every token: at N = 19 its compact list spans two tiles
    gates[2] = 0.0  # the placeholder slot
    z = torch.randn(N, L, generator=g).to(DEV)
    els = torch.empty(5, 3, I * L, dtype=torch.float8_e4m3fn, device=DEV)
    scs = torch.empty(5, 3, I * L // 32, dtype=torch.uint8, device=DEV)
    ref.mxfp4_to_fp8_ref(packed, scales, experts, els, scs)
    return z, experts, gates.to(DEV), els, scs


def live_reference(z, store, experts, gates):
    """The reference over the routed slots only (the placeholder's NaN would poison a dense sum)."""
    keep = torch.tensor([0, 1, 3], device=DEV)
    return ref.expert_mlp_mxfp4_ref(z, *store, experts[keep], gates[keep], 4.0, 25.0)


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


@pytest.mark.parametrize("N,dense", [(1, None), (5, None), pytest.param(19, None, marks=pytest.mark.slow),
                                     (19, False), (5, False)],
                         ids=["one-token", "decode", "decode19", "prefill", "compact5"])  # decode19: 40 programs
def test_fp8_and_mxfp4_mlps_match_the_reference(experts_store, N, dense, monkeypatch):
    # N = 5 fits one token tile of the dense pair layout; N = 19 takes two tiles, dense (a decode batch:
    # it must not compact, which reads the pair counts back to the host) or compact (prefill).
    if dense is None:
        monkeypatch.setattr(mlp, "_compact", lambda *a: pytest.fail("a decode-sized call synchronised"))
    z, experts, gates, els, scs = case(experts_store, N)
    want = live_reference(z, experts_store, experts, gates)
    got_fp8 = mlp._launch_mlp(z, els, scs, None, gates, 4.0, 25.0, L, I, dense=dense)
    got_mx = mlp._launch_mlp(z, *experts_store, experts, gates, 4.0, 25.0, L, I, dense=dense)
    assert got_fp8.dtype == torch.float32 and torch.isfinite(got_fp8).all(), "the unrouted NaN slot was read"
    torch.testing.assert_close(got_fp8, want, **TOL)
    torch.testing.assert_close(got_mx, want, **TOL)
    if dense is False:  # bitwise-identical weights through the same tensor-core passes: identical
        assert torch.equal(got_fp8, got_mx)
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
    gates = (torch.rand(2, 3, generator=g) + 0.1).to(DEV)
    z = torch.randn(3, L, generator=g).to(DEV)
    want = ref.expert_mlp_mxfp4_ref(z, packed, scales, experts, gates, 4.0, 25.0)
    got = mlp._launch_mlp(z, packed, scales, experts, gates, 4.0, 25.0, L, i_tail, dense=True)
    torch.testing.assert_close(got, want, **TOL)


def _run_ptx(text: str, word: int) -> list[int]:
    """Execute the straight-line PTX of ``_E2M1_PTX`` on one 32-bit input word; returns the eight outputs'
    fp16 bit patterns (the operands of its cvt.f32.f16 lines). Only the opcodes the program uses."""
    regs, out = {"$8": word, "0": 0}, {}
    val = lambda a: regs[a] if a in regs else int(a, 0)
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32":  # {lo, hi}, src
            lo, hi, src = [a.strip(" {}") for a in args.replace("}", ",").split(",") if a.strip(" {}")]
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        a = [x.strip() for x in args.split(",")]
        if op == "cvt.f32.f16":
            out[int(a[0][1:])] = regs[a[1]]
            continue
        x = [val(v) for v in a[1:]]
        if op == "shl.b32":
            r = x[0] << x[1]
        elif op == "shr.b32":
            r = x[0] >> x[1]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "prmt.b32":  # byte j of the result = byte (selector nibble j) of {x[1]:x[0]}
            both = x[0] | x[1] << 32
            r = sum(((both >> 8 * ((x[2] >> 4 * j) & 7)) & 0xFF) << 8 * j for j in range(4))
        else:
            raise AssertionError(f"opcode {op} not modelled")
        regs[a[0]] = r & 0xFFFFFFFF
    return [out[j] for j in range(8)]


def test_gpu_e2m1_ptx_decodes_every_code():
    # The GPU's one-token path decodes codes with this PTX (the interpreter cannot run it): executed here
    # instruction by instruction, each of eight codes must give the fp16 of its E2M1 value times 2^-14,
    # in element order, for every code in every position.
    values = mxfp4.e2m1_table(torch.float64) * 2.0 ** -14
    g = torch.Generator().manual_seed(3)
    words = [0x76543210, 0xFEDCBA98, 0x89ABCDEF] + torch.randint(0, 2**31, (40,), generator=g).tolist()
    for word in words:
        got = torch.tensor(_run_ptx(matvec._E2M1_PTX.value, word), dtype=torch.int32).to(torch.int16)
        got = got.view(torch.float16).double()
        want = values[[(word >> 4 * j) & 15 for j in range(8)]]
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), hex(word)


def test_public_kernels_and_unrouted_tokens(experts_store):
    # A token routed nowhere gets exactly 0; the public entry points pick the layout themselves.
    z, experts, gates, els, scs = case(experts_store, 4, seed=1)
    gates[:, 2] = 0.0
    got = mlp.expert_mlp_mxfp4(z, *experts_store, experts, gates, 4.0, 25.0)
    assert torch.equal(got[2], torch.zeros(L, device=DEV))
    torch.testing.assert_close(got, live_reference(z, experts_store, experts, gates), **TOL)
    got_fp8 = mlp.expert_mlp_fp8(z, els, scs, gates, 4.0, 25.0)
    assert torch.equal(got_fp8[2], torch.zeros(L, device=DEV))
    torch.testing.assert_close(got_fp8, got, **TOL)


@pytest.mark.parametrize("N", [2, 20])  # the matrix-vector (decode) and tensor-core (prefill) paths
def test_kernels_are_deterministic(experts_store, N, monkeypatch):
    monkeypatch.setattr(mlp, "DENSE_MAX_TOKENS", 16)  # 20 tokens take the compact (prefill) layout, two tiles
    z, experts, gates, els, scs = case(experts_store, N, seed=2)
    a = mlp.expert_mlp_mxfp4(z, *experts_store, experts, gates, 4.0, 25.0)
    b = mlp.expert_mlp_mxfp4(z, *experts_store, experts, gates, 4.0, 25.0)
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
        experts, _ = moe.conversion_plan(ids)
        gates = ((ids.unsqueeze(0) == experts.view(-1, 1, 1)) * weights).sum(-1)
    on = lambda t: t.to(DEV)  # noqa: E731
    got = mlp.expert_mlp_mxfp4(on(z), on(moe.experts_packed), on(moe.experts_scale), on(experts), on(gates),
                               moe.beta_gate, moe.beta_up)
    torch.testing.assert_close(got.cpu(), seen[0], **TOL)


def test_bad_inputs_raise_like_the_reference(experts_store):
    z, experts, gates, els, scs = case(experts_store, 3)
    packed, scales = experts_store
    calls = [
        ("expert_mlp_fp8", (z[:, :40], els, scs, gates, 4.0, 25.0)),
        ("expert_mlp_fp8", (z, els.view(torch.uint8), scs, gates, 4.0, 25.0)),
        ("expert_mlp_fp8", (z, els, scs, torch.zeros(6, 3, device=DEV), 4.0, 25.0)),
        ("expert_mlp_mxfp4", (z, packed, scales, experts[:3], gates, 4.0, 25.0)),
        ("expert_mlp_mxfp4", (z, packed, scales[:, :2], experts, gates, 4.0, 25.0)),
        ("mxfp4_to_fp8", (packed, scales, experts.float(), els, scs)),
        ("mxfp4_to_fp8", (packed, scales, torch.arange(5, device=DEV).repeat(2), els, scs)),
    ]
    for name, args in calls:
        with pytest.raises((TypeError, ValueError)) as want:
            getattr(ref, name + "_ref")(*args)
        with pytest.raises(want.type, match=str(want.value).replace("(", r"\(").replace(")", r"\)")):
            KERNELS[name](*args)
    with pytest.raises(ValueError, match="contiguous"):
        mlp.expert_mlp_mxfp4(z, packed.transpose(0, 1).contiguous().transpose(0, 1), scales, experts, gates,
                             4.0, 25.0)  # matrices of one expert not adjacent


def test_fp64_goes_to_the_reference(experts_store):
    z, experts, gates, els, scs = case(experts_store, 2)
    z64, g64 = z.double(), gates.double()
    keep = torch.tensor([0, 1, 3], device=DEV)
    got = mlp.expert_mlp_fp8(z64, els[keep], scs[keep], g64[keep], 4.0, 25.0)
    assert got.dtype == torch.float64
    assert torch.equal(got, ref.expert_mlp_fp8_ref(z64, els[keep], scs[keep], g64[keep], 4.0, 25.0))
