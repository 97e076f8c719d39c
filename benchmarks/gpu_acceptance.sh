#!/usr/bin/env bash
# Every path a user runs, on one GPU machine, each from a fresh process (nothing warmed up first):
#
#   bash benchmarks/gpu_acceptance.sh          # from the repository root; logs go to $OUT (else a temp folder)
#
# One PASS/FAIL line per check, then a summary line; exit 1 if any check failed. The checks:
# - `serve` of default and small on cuda with the default backend ("auto": on sm_90 the Gluon kernels where they
#   fit, the Triton kernels elsewhere), driven by the openai client (benchmarks/serve_check.py):
#   a greedy completion, a streamed chat and an image chat against the eager engine's text;
# - the nano-vllm workload through benchmarks/bench_serving.py: all 256 requests must finish at their length;
# - `doctor` on default (backend "triton": the portable kernels alone) and small ("auto"), whose service rung
#   starts `serve` fresh too;
# - `generate` from the command line on the GPU: the shipped model's pass-key answer;
# - the GPU test set (tests/ops, model, cache, serving, server) with the kernels compiled.
# They run in three lanes side by side (tests; the small model; the shipped model, then the doctors), so
# their timings are not figures to quote. About 5 minutes on an H100; DEADLINE (seconds, default 570)
# bounds the whole run.
# Without the openai client installed, wheels in .whl/ are installed to a temp folder first (device tool).
set -u
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}." PYTHONUNBUFFERED=1
out="${OUT:-$(mktemp -d)}"
deadline=$(( $(date +%s) + ${DEADLINE:-570} ))
if ! python -c "import openai" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    site="$(mktemp -d)"
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
        && export PYTHONPATH="$site:$PYTHONPATH"
fi
record() {  # name, exit code, log: the PASS/FAIL line
    local name="$1" rc="$2" log="$3" why=""
    [ "$rc" -eq 124 ] && why=" (timed out)"
    if [ "$rc" -eq 0 ]; then echo "[PASS] $name"
    else echo "[FAIL] $name: exit $rc$why; last lines of $log:"; tail -8 "$log" | sed 's/^/    /'; fi
}
step() {  # name, time limit (s), command...: run it fresh, bounded by the limit and the deadline
    local name="$1" limit="$2"; shift 2
    local left=$(( deadline - $(date +%s) )); [ "$left" -lt "$limit" ] && limit=$left
    local log="$out/$name.log"
    if [ "$limit" -le 5 ]; then echo "[FAIL] $name: no time left before the deadline"; return; fi
    timeout "$limit" "$@" >"$log" 2>&1
    record "$name" $? "$log"
    grep -E '^\[(PASS|FAIL)\]' "$log" | sed 's/^/    /'
}
card="$(python -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null || echo 'no GPU')"
versions="$(python -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")' 2>&1)"
echo "gpu_acceptance on $card ($versions), logs in $out"

{
tests_log="$out/gpu_tests.log"
xdist=""; python -c "import xdist" 2>/dev/null && xdist="-n 4"
timeout $(( deadline - $(date +%s) - 10 )) python -m pytest -q -p no:cacheprovider $xdist tests/ops tests/model tests/cache \
    tests/serving tests/server >"$tests_log" 2>&1 &
tests_pid=$!

PASS_KEY=$'the river runs past old town where people walk slowly The pass key of kqz is 40271. birds sing of morning light on hills far away and the sky is blue\nQ: pass key of kqz?\nA: '
# Two lanes side by side (each step still a fresh process): the small model's service and workload, and
# the shipped model's paths then the doctors. Their lines are printed lane by lane once both are done.
(
step serve_small 200 python benchmarks/serve_check.py --checkpoint small --device cuda --backend auto
step bench_serving_256 300 bash -c 'python benchmarks/bench_serving.py --config small --device cuda --backend auto \
    --num-requests 256 --input-len 100 1024 --output-len 100 512 --max-num-seqs 64 --sequential-requests 2 \
    && grep -q "Successful requests: *256" "$0"' "$out/bench_serving_256.log"
) >"$out/lane_small.txt" 2>&1 &
lane=$!
step serve_default 120 python benchmarks/serve_check.py --checkpoint default --device cuda --backend auto
step generate_cli 90 bash -c 'python -m minidsa generate "$1" --temperature 0 --device cuda \
    --no-progress | tee /dev/stderr | grep -q 40271' _ "$PASS_KEY"
step doctor_default 150 python -m minidsa doctor --checkpoint default --device cuda --backend triton
step doctor_small 240 python -m minidsa doctor --checkpoint small --device cuda
wait "$lane"
cat "$out/lane_small.txt"
wait "$tests_pid"; rc=$?
record "gpu_tests (tests/ops model cache serving server, compiled): $(tail -1 "$tests_log")" "$rc" "$tests_log"
} | tee "$out/summary.txt"
passed=$(grep -c '^\[PASS\]' "$out/summary.txt"); failed=$(grep -c '^\[FAIL\]' "$out/summary.txt")
echo "gpu_acceptance: $passed passed, $failed failed on $card ($versions)"
[ "$failed" -eq 0 ]
