#!/usr/bin/env bash
# Every GPU check of the kernels in one device call (the device tool cuts a command at 10 minutes,
# and each call pays the machine's start):
#
#   bash benchmarks/gpu_all.sh            # from the repository root, on the GPU machine
#   (device tool: command "bash benchmarks/gpu_all.sh", carry ["build/fla"])
#
# 1. the kernel parity tests compiled for the GPU (the same files CI runs in the interpreter; bf16
#    cases are added on a GPU), 2. one benchmark per kernel, 3. the whole model on both backends.
# Each step's output goes to $OUT (when set) as well as to the terminal; a failing step does not stop
# the others, and the exit status says whether any failed.
set -u
# fla-core (a pure-Python wheel, benchmark peer only) unpacked under build/fla/x: name "build/fla" in
# the device call's carry so it travels with the tree.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}.:build/fla/x"
out="${OUT:-/tmp}"
status=0
step() {
    local name="$1"; shift
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log" | tail -40
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "=== $name failed (exit $rc)"; status=1; }
}
step tests python -m pytest -q tests/ops/test_triton_kv_store.py tests/ops/test_triton_indexer.py tests/ops/test_triton_mla.py \
    tests/ops/test_triton_kda.py tests/ops/test_triton_moe.py tests/ops/test_triton_activation.py tests/ops/test_paged_ops.py
step bench_kv_store python benchmarks/bench_kv_store.py
step bench_indexer python benchmarks/bench_indexer.py
step bench_mla python benchmarks/bench_mla.py
step bench_kda python benchmarks/bench_kda.py
step bench_moe python benchmarks/bench_moe.py
step bench_activation python benchmarks/bench_activation.py
step model python benchmarks/diagnostics/model_triton_gpu.py --config small --batches 1 32 --steps 16
exit "$status"
