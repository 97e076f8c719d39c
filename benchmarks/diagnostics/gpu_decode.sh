#!/usr/bin/env bash
# The decode step's GPU checks in one device call, with a baseline tree timed on the same card:
#
#   git archive REV minidsa benchmarks | (mkdir -p build/base && tar -x -C build/base)   # on this machine
#   bash benchmarks/diagnostics/gpu_decode.sh [build/base]     # device tool: carry ["build/base"]
#
# 1. the decode kernels' parity tests compiled for the GPU, 2. the compiled step of this tree and of the
# baseline (bench_decode.py --quick: no eager graph, no dense peer; the full table is a plain
# bench_decode.py run), 3. the held-choice logits against the torch backend, 4. the expert tiles at 32
# tokens in both trees. Each step's output goes to $OUT (when set) as well as to the terminal; a failing
# step does not stop the others, and the exit status says whether any failed.
set -u
out="${OUT:-/tmp}"
base="${1:-}"
status=0
step() {
    local name="$1"; shift
    echo "=== $name: $*"
    "$@" 2>&1 | grep -v -i "warn" | tee "$out/$name.log" | tail -25
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "=== $name failed (exit $rc)"; status=1; }
}
export PYTHONPATH=.
step tests python -m pytest -q -p no:cacheprovider tests/ops/test_triton_linear.py tests/ops/test_triton_router.py \
    tests/ops/test_triton_kda_decode.py tests/ops/test_triton_moe.py
step step python benchmarks/bench_decode.py --config small --batches 1 32 --quick
[ -z "$base" ] || step step_base bash -c "cd '$base' && PYTHONPATH=. python benchmarks/bench_decode.py --config small --batches 1 32 --quick"
step held python benchmarks/diagnostics/model_triton_gpu.py --config small --batches 1 --steps 4
step tiles python benchmarks/diagnostics/moe_tile_costs.py shipped
[ -z "$base" ] || step tiles_base bash -c "cd '$base' && PYTHONPATH=. python benchmarks/diagnostics/moe_tile_costs.py shipped"
exit "$status"
