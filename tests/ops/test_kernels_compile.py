"""The Triton kernels whose constructs the interpreter does not check compile for an H100 (sm_90) on a machine
without a GPU.

The interpreter runs a kernel's Python; it never meets the compiler's front end, layouts or ptxas, so a
construct the compiler rejects (an early exit, a loop bound read from memory, a method called on an integer
argument that the compiler specialised to the constant 1) would first fail on a GPU.
``triton.compile`` with a CUDA target runs every stage down to a cubin here (the Linux wheel carries ptxas).
The tests run with the interpreter on (conftest.py), under which the kernels are not compilable objects, so
the compilation runs in a fresh process: this file as a script.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

F32_DOT = "tf32x3"
TILES = dict(BC=64, BK=128)
KERNELS = {  # kernel -> (pointer arguments of a non-fp32 type, constexprs besides TILES and the flags)
    "_chunk_decay_kernel": ({"len_ptr": "*i64"}, {}),
    "_chunk_pairs_kernel": ({"len_ptr": "*i64", "aqk_ptr": "*bf16"}, dict(KC=32)),
    "_chunk_solve_kernel": ({"len_ptr": "*i64", "w_ptr": "*bf16"}, dict(BVF=128, WC=64)),
    "_chunk_state_kernel": ({"len_ptr": "*i64", "keep_ptr": "*i32", "hs_ptr": "*bf16"}, dict(BV=32, BVF=128)),
    "_chunk_output_kernel": ({"len_ptr": "*i64", "o_ptr": "*bf16"}, dict(BV=128, BVF=128)),
}
FLAGS = {"lengths, kept states": dict(HAS_LEN=True, KEEP=True, HAS_S0=True),
         "plain": dict(HAS_LEN=False, KEEP=False, HAS_S0=False)}


# Kernels compiled as they are launched, and with the integer arguments that Triton turns into constants when
# they equal 1: module -> kernel -> [(constexprs, pointer types besides *fp32)].
OTHER_KERNELS = {
    "minidsa.ops.attn_res.mix_triton": {"_mix_kernel": [
        ({"BLOCK_R": 4, "BLOCK_D": 1024, "N_PAD": 4, **one}, {}) for one in ({}, {"R": 1}, {"N": 1, "N_PAD": 1})]},
    "minidsa.ops.kda_step.conv_triton": {"_short_conv_kernel": [
        (dict(W=4, WP=4, BT=32, BC=128, HAS_LEN=has_len, **one), {"x_ptr": "*bf16", "len_ptr": "*i64"})
        for has_len in (True, False) for one in ({}, {"T": 1})]},
    "minidsa.ops.norm.rms_triton": {"_rms_norm_kernel": [
        (dict(BLOCK_D=block, ROWS=rows, ROUND=rnd, **one), {"x_ptr": "*fp32" if rnd else "*bf16", "y_ptr": "*bf16"})
        for block, rows in ((8192, 1), (128, 32)) for one in ({}, {"n_rows": 1}) for rnd in (False, True)]},
    "minidsa.ops.activation.situ_glu_triton": {"_fwd_kernel": [
        (dict(BLOCK=2048, RNE=rne), {"g_ptr": "*bf16", "u_ptr": "*bf16", "h_ptr": "*bf16" if rne else "*fp32"})
        for rne in (True, False)]},
    "minidsa.ops.moe_router.plan_triton": {"_plan_kernel": [
        (dict(TOP_K=8, BLOCK_E=64, BLOCK_P=64, BLOCK_M=64, BLOCK_N=32),
         {"ids_ptr": "*i64", "experts_ptr": "*i64", "count_ptr": "*i64", "slot_ptr": "*i32"})]},
    "minidsa.ops.gate.gate_triton": {"_gate_kernel": [
        (dict(NORM=norm, RNE=True, ROWS=64, BLOCK_K=64), {"g_ptr": "*bf16", "y_ptr": "*bf16"}) for norm in (True, False)]},
    "minidsa.ops.kda_step.inputs_triton": {"_inputs_kernel": [
        (dict(ROWS=64, BLOCK_K=64), {"z_ptr": "*bf16", "b_ptr": "*bf16"})]},
}
FLOATS = ("eps", "lower_bound", "beta_gate", "beta_up")  # the scalar arguments passed as Python floats


def compile_other(module: str, name: str, consts: dict, types: dict) -> bytes:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(module), name)
    signature = {arg: "constexpr" if arg in consts else types.get(arg, "*fp32") if arg.endswith("_ptr") else
                 "fp32" if arg in FLOATS else "i32" for arg in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


def compile_kernel(name: str, flags: dict) -> bytes:
    """The cubin of kernel ``name`` of ops/kda/chunk_triton.py for sm_90, bf16 dots (needs the interpreter off)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minidsa.ops.kda import chunk_triton as ct
    fn = getattr(ct, name)
    types, consts = KERNELS[name]
    consts = {**TILES, **consts, **{k: v for k, v in flags.items() if k in fn.arg_names}}
    if "DOT" in fn.arg_names:
        consts.update(DOT=triton.language.bfloat16, F32=F32_DOT)
    signature = {arg: "constexpr" if arg in consts else types.get(arg, "*fp32") if arg.endswith("_ptr") else
                 "fp32" if arg == "scale" else "i32" for arg in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


@pytest.mark.slow
@pytest.mark.parametrize("flags", list(FLAGS))
def test_chunk_kernels_compile_for_sm90(flags):
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, flags], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [f"{name}:ok" for name in KERNELS]


@pytest.mark.slow
def test_other_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, "other"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [f"{name}:ok" for kernels in OTHER_KERNELS.values() for name in kernels]


if __name__ == "__main__":
    if sys.argv[1] == "other":
        for module, kernels in OTHER_KERNELS.items():
            for kernel, variants in kernels.items():
                for consts, types in variants:
                    assert compile_other(module, kernel, consts, types)
                print(f"{kernel}:ok")
    else:
        for kernel in KERNELS:
            assert compile_kernel(kernel, FLAGS[sys.argv[1]])
            print(f"{kernel}:ok")
