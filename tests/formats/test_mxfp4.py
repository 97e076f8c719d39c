"""MXFP4 known answers (OCP E2M1 / E8M0, gpt-oss packing) and the exact FP8 conversion."""

import pytest
import torch

from minidsa.formats import mxfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_every_code_decodes_to_its_value():
    # 32 elements: codes 0..15 then 15..0; element 2i is the LOW nibble of byte i.
    codes = list(range(16)) + list(range(15, -1, -1))
    packed = torch.tensor([[codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(16)]], dtype=torch.uint8)
    scales = torch.tensor([[127]], dtype=torch.uint8)  # 2^0
    got = mxfp4.dequantize(packed, scales)
    assert got[0].tolist() == [E2M1[c] for c in codes]


def test_nibble_order():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x71  # low nibble 1 (0.5) is element 0, high nibble 7 (6.0) is element 1
    got = mxfp4.dequantize(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert got[0, :3].tolist() == [0.5, 6.0, 0.0]
    p, _ = mxfp4.quantize(torch.tensor([[0.5, 6.0] + [0.0] * 30]))
    assert p[0, 0].item() == 0x71


def test_e8m0_extremes_and_nan():
    packed = torch.full((1, 16), 0x22, dtype=torch.uint8)  # every element 1.0
    lo = mxfp4.dequantize(packed, torch.tensor([[0x00]], dtype=torch.uint8), torch.float64)
    hi = mxfp4.dequantize(packed, torch.tensor([[0xFE]], dtype=torch.uint8), torch.float64)
    assert lo[0, 0].item() == 2.0 ** -127 and hi[0, 0].item() == 2.0 ** 127
    with pytest.raises(ValueError, match="0xFF"):
        mxfp4.dequantize(packed, torch.tensor([[0xFF]], dtype=torch.uint8))


def brute_quantize(w):
    """Nearest E2M1 value of w / 2^e (ties to the even code), e = floor(log2(amax)) - 2 per 32-group."""
    out = []
    for group in w.double().reshape(-1, 32):
        amax = float(group.abs().max())
        e = max(-127, min(127, (torch.floor(torch.log2(torch.tensor(amax))).item() - 2) if amax > 0 else -127))
        vals = []
        for x in (group / 2.0 ** e).tolist():
            best = min(range(8), key=lambda c: (abs(abs(x) - E2M1[c]), c % 2))  # distance, then even code
            vals.append((-1 if x < 0 else 1) * E2M1[best] * 2.0 ** e)
        out.append(vals)
    return torch.tensor(out, dtype=torch.float64).reshape(w.shape)


def test_quantize_matches_brute_force_and_rounds_ties_to_even():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0, 7.9, 0.1] + [0.0] * 20)
    p, s = mxfp4.quantize(ties.view(1, 32))
    assert s.item() == 127  # amax 7.9: floor(log2 7.9) - 2 = 0
    assert mxfp4.dequantize(p, s)[0, :12].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -4.0, 6.0, 0.0]
    w = torch.randn(6, 96) * torch.logspace(-4, 2, 6).unsqueeze(1)
    p, s = mxfp4.quantize(w)
    assert p.shape == (6, 48) and s.shape == (6, 3) and p.dtype == s.dtype == torch.uint8
    assert torch.equal(mxfp4.dequantize(p, s, torch.float64), brute_quantize(w))


def test_quantize_exponent_is_exact_below_a_power_of_two_and_signs_survive_underflow():
    # amax one ulp below 4: floor(log2 amax) = 1, so e = -1 (code 126) and amax / 2^-1 ~ 8 saturates at 6
    # (code 7). A rounded log2 would say 2 and give code 127. Holds for fp64 and fp32 weights alike.
    for dtype in (torch.float64, torch.float32):
        w = torch.zeros(1, 32, dtype=dtype)
        w[0, 0] = torch.nextafter(torch.tensor(4.0, dtype=dtype), torch.tensor(0.0, dtype=dtype))
        p, s = mxfp4.quantize(w)
        assert s.item() == 126 and p[0, 0].item() & 0x0F == 7, dtype
    # amax 2^100 (e = 98) beside -2^-60: the quotient -2^-158 is below fp32's range, the element still
    # rounds to -0 (code 8, sign kept), and a group of zeros gets the smallest scale (code 0).
    w = torch.zeros(2, 32)
    w[0, 0], w[0, 1] = 2.0 ** 100, -(2.0 ** -60)
    p, s = mxfp4.quantize(w)
    assert s.tolist() == [[98 + 127], [0]]
    assert p[0, 0].item() == 0x86 and p[1].eq(0).all()  # low nibble: 2^100 / 2^98 = 4.0 (code 6); high: -0


def test_quantization_error_bound():
    w = torch.randn(64, 256)
    deq = mxfp4.dequantize(*mxfp4.quantize(w))
    err = (deq - w).abs().reshape(64, 8, 32)
    amax = w.abs().reshape(64, 8, 32).amax(-1, keepdim=True)
    # With 4 * 2^e <= amax < 8 * 2^e: rounding costs at most half the largest step (2^e <= amax / 4),
    # saturation at 6 * 2^e costs amax - 6 * 2^e < amax / 4.
    assert (err <= amax / 4).all()
    # typical error is far below the bound: E2M1 has one mantissa bit (~1/4 relative error on average)
    assert (err.mean() / w.abs().mean()) < 0.15


def test_k_not_multiple_of_32_is_an_error():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.randn(2, 48))
    with pytest.raises(ValueError, match="NaN"):
        mxfp4.quantize(torch.tensor([[float("nan")] * 32]))


def test_fp8_conversion_is_exact():
    w = torch.randn(16, 128) * torch.logspace(-6, 3, 16).unsqueeze(1)
    p, s = mxfp4.quantize(w)
    elements, scales = mxfp4.to_fp8(p, s)
    assert elements.dtype == torch.float8_e4m3fn and torch.equal(scales, s)
    assert torch.equal(mxfp4.fp8_dequantize(elements, scales), mxfp4.dequantize(p, s))
    # every code survives the round trip through e4m3
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(2).view(1, 16)
    el, _ = mxfp4.to_fp8(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert el.float()[0, :16].tolist() == E2M1


def test_scale_folding_limit_is_14_binades():
    ok = torch.tensor([[100, 114, 107]], dtype=torch.uint8)
    too_wide = torch.tensor([[100, 115, 107]], dtype=torch.uint8)
    assert mxfp4.check_fold(ok).item() and not mxfp4.check_fold(too_wide).item()
    # and the limit is real: with a 14-binade spread every element is exact in e4m3 after folding
    s_ref = 114 - 6
    for s in (100, 114):
        folded = torch.tensor(E2M1) * 2.0 ** (s - s_ref)
        assert torch.equal(folded.to(torch.float8_e4m3fn).float(), folded)
    folded = torch.tensor([0.5]) * 2.0 ** (99 - s_ref)  # 15 binades: 2^-10 is below e4m3's 2^-9
    assert not torch.equal(folded.to(torch.float8_e4m3fn).float(), folded)
