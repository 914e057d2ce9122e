#!/usr/bin/env bash
# The far/band split's GPU tests (relative_band_gpu_test, layers_gpu_test, attention_gpu_test)
# from an unpacked bundle, each one's output in OUT_DIR and its failures printed; exits 1 if
# any failed. Called by relative_split_check.sh and relative_split_ab.sh.
#
#   bash bench/relative_split_tests.sh BUNDLE_DIR OUT_DIR
set -u
b="$1"; out="$2"; failed=0
for t in relative_band_gpu_test layers_gpu_test attention_gpu_test; do
  start=$(date +%s)
  "$b/run.sh" $t >"$out/$t.txt" 2>&1; rc=$?
  echo "$t: rc $rc, $(( $(date +%s) - start )) s"; [ $rc = 0 ] || failed=1
  grep -E "^\[  (FAILED|PASSED) |Failure|rror|Expected|Which is|actual|\" (dq|dk|dv|dtable|out|lse)" "$out/$t.txt" | head -40
done
exit $failed
