#!/usr/bin/env bash
# Builds and runs te_server's C++ tests (unit and integration: the integration
# tests start the instrumented te_server) under AddressSanitizer (with
# LeakSanitizer) and UndefinedBehaviorSanitizer, compiled by clang-14, CPU
# backend only: bazel test --config=asan (.bazelrc).
#
#   tests/sanitizers/run_asan.sh [TARGET...]   default: //kernels/... //server/... //client/... //bench/load/... //tests/...
#
# Bazel runs under its own --output_base (ASAN_OUTPUT_BASE, default
# ~/.cache/te_server_asan_bazel): the clang toolchain lives there and the
# default gcc build is never invalidated. That server exits after 10 idle
# minutes. Prints "N passed, N failed" last; exit status is Bazel's.
# Needs: clang-14 libclang-rt-14-dev (and the -dev packages the build uses).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
output_base="${ASAN_OUTPUT_BASE:-$HOME/.cache/te_server_asan_bazel}"
if (( $# > 0 )); then
  targets=("$@")
else
  targets=(//kernels/... //server/... //client/... //bench/load/... //tests/...)
fi

start=$(date +%s)
log="$(mktemp /tmp/te_asan.XXXXXX.log)"
bazel --output_base="$output_base" --max_idle_secs=600 test --config=asan \
  --test_lang_filters=cc --keep_going "${targets[@]}" 2>&1 | tee "$log" |
  grep -v "Cannot export local symbol '__asan"  # gold's noise about ASan's helpers
status=${PIPESTATUS[0]}
end=$(date +%s)

passed=$(grep -cE '^//.* (PASSED|FLAKY)' "$log")
failed=$(grep -cE '^//.* (FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD)' "$log")
echo "run_asan: $((end - start)) s; log: $log"
echo "$passed passed, $failed failed"
exit "$status"
