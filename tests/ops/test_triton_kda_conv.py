"""KDA's short conv kernel (minidsa/ops/kda_step/conv_triton.py) against its reference, on odd shapes, under
TRITON_INTERPRET=1 on the CPU (or compiled on a GPU)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minidsa.ops.kda_step import conv_triton as kern  # noqa: E402
from minidsa.ops.kda_step.reference import causal_conv, short_conv_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(B, T, C, W=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).to(DEV, dtype)
    weight = torch.randn(C, 1, W, generator=g).to(DEV)
    state = torch.randn(B, W - 1, C, generator=g).to(DEV)
    return x, weight, state


def test_reference_is_silu_of_the_conv_with_each_rows_own_end():
    """The state at a row's end equals the conv state of running that row's first lengths[b] inputs alone."""
    x, weight, state = inputs(3, 9, 6)
    lengths = torch.tensor([9, 1, 5])
    y, new_state = short_conv_ref(x, weight, state, lengths)
    torch.testing.assert_close(y, torch.nn.functional.silu(causal_conv(x, weight, state)[0]), rtol=0, atol=0)
    for b, n in enumerate(lengths.tolist()):
        alone = causal_conv(x[b:b + 1, :n], weight, state[b:b + 1])[1]
        torch.testing.assert_close(new_state[b:b + 1], alone, rtol=0, atol=0)


# fp32 on both sides; the kernel's multiply-adds may fuse (one rounding instead of two per tap)
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("B,T,C,W,lengths", [(2, 63, 60, 4, None), (3, 20, 33, 4, [20, 1, 0]), (1, 2, 7, 4, None),
                                             (2, 5, 9, 2, [3, 5]), (2, 17, 40, 3, [17, 16])])
def test_kernel_matches_the_reference(B, T, C, W, lengths):
    x, weight, state = inputs(B, T, C, W)
    lens = None if lengths is None else torch.tensor(lengths, device=DEV)
    y, new_state = kern.short_conv(x, weight, state, lens)
    want_y, want_state = short_conv_ref(x, weight, state, lens)
    torch.testing.assert_close(y, want_y, **TOL)
    torch.testing.assert_close(new_state, want_state, rtol=0, atol=0)  # copies of inputs: exact


def test_bf16_inputs_and_an_empty_rectangle():
    x, weight, state = inputs(2, 11, 24, dtype=torch.bfloat16)
    for got, want in zip(kern.short_conv(x, weight, state), short_conv_ref(x, weight, state)):
        torch.testing.assert_close(got, want, **TOL)
    y, new_state = kern.short_conv(x[:, :0], weight, state)
    assert y.shape == (2, 0, 24)
    torch.testing.assert_close(new_state, state, rtol=0, atol=0)


def test_bad_input_is_rejected_like_the_reference():
    x, weight, state = inputs(2, 5, 8)
    for bad in ((x, weight, state[:1]), (x, weight[:7], state), (x[0], weight, state),
                (x, weight, state, torch.tensor([1.0, 2.0]))):
        for fn in (short_conv_ref, kern.short_conv):
            with pytest.raises((ValueError, TypeError)):
                fn(*bad)
