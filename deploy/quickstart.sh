#!/usr/bin/env bash
# The main job: builds te_server and the quickstart client, starts the server
# on the default device (--device=auto: the first GPU if there is one, else
# the CPU), runs TE's JAX quickstart through it, and stops the server.
# Extra arguments go to the quickstart (e.g. --config=quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build //server:te_server //client:quickstart
port_file=$(mktemp)
trap 'kill "${server_pid:-}" 2>/dev/null || true; rm -f "$port_file"' EXIT
bazel-bin/server/te_server --device=auto --host=127.0.0.1 --port=0 --port_file="$port_file" &
server_pid=$!
for _ in $(seq 1 100); do
  [ -s "$port_file" ] && break
  kill -0 "$server_pid" 2>/dev/null || { echo "te_server exited during start" >&2; exit 1; }
  sleep 0.1
done
[ -s "$port_file" ] || { echo "te_server did not start listening" >&2; exit 1; }
bazel-bin/client/quickstart --server="127.0.0.1:$(cat "$port_file")" "$@"
