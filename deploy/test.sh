#!/usr/bin/env bash
# Runs the test suite (everything but GPU tests and benchmarks) and prints
# "N passed, N failed" counted from the test cases' results.
set -uo pipefail
cd "$(dirname "$0")/.."
bazel test //... "$@" 2>&1 | tee /tmp/te_test_log.txt
bazel_rc=${PIPESTATUS[0]}
python3 deploy/count_results.py bazel-testlogs /tmp/te_test_log.txt
count_rc=$?
# Bazel exits 4 when no test target matched; anything else non-zero is a failure.
if [ "$count_rc" -ne 0 ] || { [ "$bazel_rc" -ne 0 ] && [ "$bazel_rc" -ne 4 ]; }; then exit 1; fi
