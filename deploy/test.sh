#!/usr/bin/env bash
# Runs the test suite: every Bazel test but GPU tests and benchmarks (C++ unit
# and integration tests against a real te_server), then the Python client's
# pytest suite against a real te_server. Prints "N passed, N failed" counted
# from the individual test cases.
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp) junit=$(mktemp --suffix=.xml)
bazel test //... "$@" 2>&1 | tee "$log"
bazel_rc=${PIPESTATUS[0]}
python_rc=0
if bazel build //server:te_server >/dev/null 2>&1; then
  bash client/python/run_tests.sh "$junit" || python_rc=$?
else
  echo "te_server did not build: the Python client tests cannot run" >&2
  python_rc=1
  rm -f "$junit"
fi
python3 deploy/count_results.py bazel-testlogs "$log" "$junit"
count_rc=$?
rm -f "$log" "$junit"
# Bazel exits 4 when no test target matched; anything else non-zero is a failure.
if [ "$count_rc" -ne 0 ] || [ "$python_rc" -ne 0 ] || { [ "$bazel_rc" -ne 0 ] && [ "$bazel_rc" -ne 4 ]; }; then
  exit 1
fi
