#!/usr/bin/env bash
# The many-client figures (one GPU, then two), in one call on a GPU machine, from the bundle
# folder that deploy/bundle.sh makes (te_server, te_bench, run.sh):
#
#   bundle/run_multi_client_bench.sh     # tables on stdout; with $OUT set, the
#                                        # JSON reports and logs land there too
#
#   1. one GPU (cuda:0): te_bench with 1 and 8 clients, each its own session,
#      TransformerLayer (quickstart size) under FP8 DelayedScaling,
#      ForwardBackward on resident tensors;
#   2. every GPU the machine has (--device=all), when it has more than one:
#      the same load with 2 x GPUs and 8 clients, sessions placed by the
#      server on the least-loaded device;
#   3. RATIO lines: 8 clients / 1 client on one GPU (throughput, target >=
#      0.95) and the slowest / fastest client (target >= 0.8); all GPUs / one
#      GPU at the same client count (target >= 1.8 with two GPUs).
# Environment: TE_BENCH_DURATION_S (per sweep point, default 8),
# TE_BENCH_CONFIG (quickstart), PYTHON (python3).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
duration="${TE_BENCH_DURATION_S:-8}"
config="${TE_BENCH_CONFIG:-quickstart}"
python="${PYTHON:-python3}"
work="${OUT:-$(mktemp -d /tmp/te_multi.XXXXXX)}"
mkdir -p "$work"

server_pid=""
server_port=""
start_server() {  # LOG FLAGS...
  local log="$1"; shift
  local port_file="$work/server.port"
  rm -f "$port_file"
  "$here/run.sh" te_server --host=127.0.0.1 --port=0 --port_file="$port_file" "$@" >"$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 600); do
    [ -s "$port_file" ] && { server_port="$(cat "$port_file")"; return 0; }
    kill -0 "$server_pid" 2>/dev/null || { tail -n 20 "$log" >&2; server_pid=""; return 1; }
    sleep 0.1
  done
  return 1
}
stop_server() {
  [ -n "$server_pid" ] || return 0
  kill -TERM "$server_pid" 2>/dev/null
  for _ in $(seq 1 150); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  server_pid=""
}
trap stop_server EXIT

# bench NAME CLIENTS SERVER_FLAGS...: one te_bench sweep against a fresh server.
bench() {
  local name="$1" clients="$2"; shift 2
  echo "== $name: te_server $* ; te_bench --clients=$clients" >&2
  start_server "$work/server_$name.log" --session_memory_bytes=$((12 << 30)) "$@" || return 1
  "$here/run.sh" te_bench --server="127.0.0.1:$server_port" --clients="$clients" --layer=transformer \
    --config="$config" --fp8=delayed --op=forward_backward --duration_s="$duration" --warmup=3 \
    --json="$work/$name.json" 2>"$work/te_bench_$name.stderr"
  local rc=$?
  stop_server
  return $rc
}

gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
echo "GPUs: $gpus ($(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null)); commit: $(head -1 "$here/COMMIT" 2>/dev/null)"
bench one_gpu 1,8 --device=cuda:0
if [ "$gpus" -gt 1 ]; then
  bench all_gpus "$((gpus)),8" --device=all
fi

# Ratios from the JSON reports.
"$python" - "$work" <<'EOF'
import json, os, sys
work = sys.argv[1]
def points(name):
    path = os.path.join(work, name + ".json")
    if not os.path.exists(path):
        return {}
    return {p["clients"]: p for p in json.load(open(path))["points"]}
one, every = points("one_gpu"), points("all_gpus")
def tput(p): return p["steps_per_s"]
if 1 in one and 8 in one:
    print("RATIO 8 clients / 1 client, one GPU: %.3f (target >= 0.95)" % (tput(one[8]) / tput(one[1])))
    print("RATIO slowest / fastest client, 8 clients, one GPU: %.3f (target >= 0.8)"
          % one[8]["fairness"]["slowest_over_fastest"])
if 8 in one and 8 in every:
    print("RATIO all GPUs / one GPU, 8 clients: %.3f (target >= 1.8 with two GPUs)" % (tput(every[8]) / tput(one[8])))
    print("RATIO slowest / fastest client, 8 clients, all GPUs: %.3f" % every[8]["fairness"]["slowest_over_fastest"])
EOF
