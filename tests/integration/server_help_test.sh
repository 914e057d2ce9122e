#!/usr/bin/env bash
# te_server --help lists the server's own flags (main, security, metrics) and
# exits 0: an operator's first question about a binary.
set -uo pipefail
server="$1"
out=$("$server" --help 2>&1)
status=$?
# absl's --help exits 1 after printing; anything else means it did not get there.
if [ "$status" -ne 0 ] && [ "$status" -ne 1 ]; then
  echo "te_server --help exited $status:"; echo "$out"; exit 1
fi
missing=0
for flag in --port --device --session_memory_bytes --max_micro_batches --sequence_gap_seconds \
            --state_dir --tls_cert --metrics_port; do
  if ! grep -q -- "$flag " <<<"$out"; then
    echo "te_server --help does not list $flag"; missing=1
  fi
done
if grep -q "No flags matched" <<<"$out"; then echo "te_server --help: No flags matched"; missing=1; fi
[ "$missing" -eq 0 ] && echo "te_server --help lists its flags"
exit "$missing"
