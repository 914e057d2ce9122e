#!/usr/bin/env bash
# One build-check-time cycle of the small-head attention kernels on the GPU
# machine, from a bundle made on the build machine:
#
#   BUNDLE_TARGETS="//kernels/cuda:attention_gpu_test //bench/kernels:attention_small_head_bench" \
#     deploy/bundle.sh .bundle/small_head          # on the build machine
#   bench/kernels/run_small_head_attention.sh .bundle/small_head [OUT]   # on the GPU machine
#
# Runs the attention GPU tests (every path against the CPU reference), then
# the benchmark, and writes logs and the hot kernels' register / spill report
# under OUT. The last lines printed are the summary.
set -uo pipefail
bundle="${1:?usage: $0 BUNDLE [OUT]}"
out="${2:-${OUT:-/tmp/small_head_out}}"
mkdir -p "$out"

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv \
  >"$out/gpu.txt" 2>&1

# Registers, spills and the SASS of the small-head kernels (cuobjdump is on
# the GPU machine, not the build machine).
export PATH="/usr/local/cuda/bin:/usr/local/cuda-13.0/bin:$PATH"
kernels_so="$(ls "$bundle"/*libkernels.so 2>/dev/null | head -n 1)"
if command -v cuobjdump >/dev/null && [ -n "$kernels_so" ]; then
  cuobjdump -res-usage "$kernels_so" >"$out/resources.txt" 2>&1 || true
  sass="$(mktemp)"
  cuobjdump -sass "$kernels_so" 2>/dev/null \
    | awk '/Function : /{keep = ($3 ~ /SmallHead/)} keep' >"$sass" || true
  awk '/Function : /{name = $3} /LDL|STL/{n[name]++} END{for (k in n) print n[k], k}' \
    "$sass" >"$out/small_head_local_memory.txt"
  # The quickstart's kernels (D 4) in full; all of them are too large to return.
  awk '/Function : /{keep = ($3 ~ /ILi4E/)} keep' "$sass" >"$out/small_head_d4_sass.txt"
  rm -f "$sass"
fi

"$bundle/run.sh" attention_gpu_test --gtest_brief=1 >"$out/attention_gpu_test.log" 2>&1
test_rc=$?
"$bundle/run.sh" attention_small_head_bench ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
bench_rc=$?
# Without dropout: how much of the time the dropout hash takes.
"$bundle/run.sh" attention_small_head_bench --dropout=0 >"$out/bench_no_dropout.log" 2>&1

echo "=== gpu"; cat "$out/gpu.txt"
echo "=== local memory instructions per small-head kernel (none listed is good)"
sed 's/_ZN2te4cuda[^S]*SmallHead/SmallHead/' "$out/small_head_local_memory.txt" 2>/dev/null | head -40
echo "=== attention_gpu_test (rc $test_rc)"
grep -E '^\[  (FAILED|PASSED)|^\[==========\]|Failure|Expected|Which is|error|out$|dq$|dk$|dv$' \
  "$out/attention_gpu_test.log" | head -60
echo "=== attention_small_head_bench (rc $bench_rc)"
cat "$out/bench.log"
echo "=== without dropout"
grep -E '^\||^speedup' "$out/bench_no_dropout.log"
