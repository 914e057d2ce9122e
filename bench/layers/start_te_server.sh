# Sourced by the bundle's client benchmarks (compare_quickstarts.sh,
# run_train_lm.sh) after they set $bundle and $out:
#   start_te_server [TE_SERVER_FLAGS...]
# sets $py (python3 when it has grpc, protobuf and numpy, else the torch venv's),
# starts "$bundle/run.sh te_server --device=cuda:0" on a free local port with
# the given flags, logging to $out/server.log, and sets $server (its pid) and
# $address once it has written its port (30 s at most).
start_te_server() {
  py=python3
  $py -c "import grpc, google.protobuf, numpy" 2>/dev/null || py=/opt/torch/.venv/bin/python
  local port_file
  port_file="$(mktemp)"; rm -f "$port_file"
  "$bundle/run.sh" te_server --device=cuda:0 --host=127.0.0.1 --port=0 --port_file="$port_file" \
    "$@" >"$out/server.log" 2>&1 &
  server=$!
  for _ in $(seq 300); do [ -s "$port_file" ] && break; sleep 0.1; done
  address="127.0.0.1:$(cat "$port_file")"
}
