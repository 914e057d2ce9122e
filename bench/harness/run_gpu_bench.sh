#!/usr/bin/env bash
# The GPU benchmark harness (the quickstart layer against the peers, client
# against server time with resident tensors, many clients), in one call on the GPU machine, from the bundle
# folder that deploy/bundle.sh makes (it holds te_server, layer_bench,
# te_bench, run.sh, this script, summarize.py, jax_memory.py and the peers):
#
#   bundle/run_gpu_bench.sh        # the table on stdout; with $OUT set, also
#                                  # $OUT/bench.md, $OUT/bench_raw.txt, $OUT/logs/
#
# Stages, in order, each under a time limit; a stage that fails or runs out
# of time is reported and the next one still runs:
#   1. ours: per variant, a fresh te_server on the GPU (so each variant's
#      memory reading starts from an empty allocator) and layer_bench;
#   2. te_bench: 1 and 8 clients on one GPU, TransformerLayer under FP8;
#   3. peers: jax_peers.py, torch_peers.py (the latter prints the CEIL lines);
#   4. JAX's peak memory per step (jax_memory.py);
#   5. summarize.py: the table.
# Environment: TE_BENCH_BUDGET_S (whole run, default 520), TE_BENCH_VARIANTS
# (default "1 2 3 4 5 6 7"), TE_BENCH_DEVICE (cuda:0), TE_BENCH_CONFIG
# (quickstart), TE_BENCH_CLIENTS (0: leave out stage 2), PYTHON (python3).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
start_s=$(date +%s)
budget_s="${TE_BENCH_BUDGET_S:-520}"
variants="${TE_BENCH_VARIANTS:-1 2 3 4 5 6 7}"
device="${TE_BENCH_DEVICE:-cuda:0}"
config="${TE_BENCH_CONFIG:-quickstart}"
python="${PYTHON:-python3}"
gpu_index="${device#cuda:}"
case "$gpu_index" in '' | *[!0-9]*) gpu_index=0 ;; esac

work="${OUT:-$(mktemp -d /tmp/te_bench.XXXXXX)}"
logs="$work/logs"
mkdir -p "$logs"
raw="$work/bench_raw.txt"  # every line summarize.py reads
: >"$raw"
failures=()

say() { echo "== $* ($(( $(date +%s) - start_s )) s)" >&2; }
record() { tee -a "$raw"; }

# limit CAP RESERVE: seconds a stage may take: CAP, or less when the budget
# must keep RESERVE seconds for the stages after it; 0 when nothing is left.
limit() {
  local left=$(( budget_s - ($(date +%s) - start_s) - $2 ))
  if [ "$left" -lt 10 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

# stage NAME CAP RESERVE COMMAND...: runs COMMAND (a program, not a shell
# function: timeout execs it) under its limit, its stdout to stdout and the
# raw log, its stderr to logs/NAME.stderr; a failure or timeout is reported
# (a STAGE line, which summarize.py lists), not fatal.
stage() {
  local name="$1" cap="$2" reserve="$3"; shift 3
  local t; t=$(limit "$cap" "$reserve")
  if [ "$t" -eq 0 ]; then
    echo "STAGE $name SKIPPED: out of time" | record
    failures+=("$name: skipped (out of time)")
    return 1
  fi
  say "$name (limit ${t} s)"
  timeout --kill-after=10 "$t" "$@" 2>>"$logs/$name.stderr" | record
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "STAGE $name TIMED OUT after ${t} s" | record
    failures+=("$name: timed out after ${t} s")
  elif [ "$rc" -ne 0 ]; then
    echo "STAGE $name FAILED (exit $rc; see logs/$name.stderr)" | record
    tail -n 5 "$logs/$name.stderr" >&2
    failures+=("$name: exit $rc")
  fi
  return "$rc"
}

# ---- te_server ------------------------------------------------------------------
server_pid=""
server_port=""
# start_server LOG [FLAGS...]: a te_server on a free loopback port.
start_server() {
  local log="$1"; shift
  local port_file="$work/server.port"
  rm -f "$port_file"
  "$here/run.sh" te_server --device="$device" --host=127.0.0.1 --port=0 --port_file="$port_file" "$@" \
    >"$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 600); do  # up to 60 s: CUDA and cuDNN initialise first
    if [ -s "$port_file" ]; then
      server_port="$(cat "$port_file")"
      return 0
    fi
    if ! kill -0 "$server_pid" 2>/dev/null; then
      echo "te_server exited at start; its log ends:" >&2
      tail -n 20 "$log" >&2
      server_pid=""
      return 1
    fi
    sleep 0.1
  done
  echo "te_server did not listen within 60 s" >&2
  stop_server
  return 1
}
# stop_server: SIGTERM (graceful), SIGKILL after 15 s.
stop_server() {
  [ -n "$server_pid" ] || return 0
  kill -TERM "$server_pid" 2>/dev/null
  for _ in $(seq 1 150); do
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  server_pid=""
}
trap stop_server EXIT

memory_probe=""
if command -v nvidia-smi >/dev/null 2>&1; then
  memory_probe="nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i $gpu_index"
fi

# ---- setup ---------------------------------------------------------------------------
{
  echo "SETUP date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "SETUP host: $(uname -n)"
  if [ -n "$memory_probe" ]; then
    echo "SETUP GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader -i "$gpu_index" 2>/dev/null)"
  fi
  [ -f "$here/COMMIT" ] && echo "SETUP commit: $(tr "\n" " " <"$here/COMMIT")"
  echo "SETUP command: $0 (config $config, device $device, variants $variants)"
} | record

# ---- 1. ours ---------------------------------------------------------------------------
# One variant per server: the caching allocator keeps what a session reserved,
# so a reused server would hide the next variant's memory. The server runs in
# this shell (so it is always stopped); the time limit is layer_bench's.
# Each variant's limit keeps 4 minutes for the peers and the summary.
for v in $variants; do
  if [ "$(limit 75 240)" -eq 0 ]; then
    echo "STAGE ours_v$v SKIPPED: out of time" | record
    failures+=("ours_v$v: skipped (out of time)")
    continue
  fi
  if ! start_server "$logs/server_v$v.log" --session_memory_bytes=$((64 << 30)); then
    echo "STAGE ours_v$v FAILED: te_server did not start (logs/server_v$v.log)" | record
    failures+=("ours_v$v: te_server did not start")
    continue
  fi
  stage "ours_v$v" 75 240 "$here/run.sh" layer_bench --server="127.0.0.1:$server_port" --config="$config" \
    --variants="$v" --memory_probe="$memory_probe"
  stop_server
done

# ---- 2. te_bench: many clients on one GPU ------------------------------------------------
if [ "${TE_BENCH_CLIENTS:-1}" = "0" ]; then
  echo "te_bench stage left out (TE_BENCH_CLIENTS=0; run_multi_client_bench.sh has it)" >&2
elif [ "$(limit 75 220)" -eq 0 ]; then
  echo "STAGE te_bench SKIPPED: out of time" | record
  failures+=("te_bench: skipped (out of time)")
elif ! start_server "$logs/server_te_bench.log" --session_memory_bytes=$((12 << 30)); then
  echo "STAGE te_bench FAILED: te_server did not start (logs/server_te_bench.log)" | record
  failures+=("te_bench: te_server did not start")
else
  stage te_bench 75 220 "$here/run.sh" te_bench --server="127.0.0.1:$server_port" --clients=1,8 \
    --layer=transformer --config="$config" --fp8=delayed --op=forward_backward --duration_s=8 --warmup=3 \
    --device="$device" --json="$work/te_bench.json"
  stop_server
fi

# ---- 3. peers ------------------------------------------------------------------------------
find_peer() {
  local f
  for f in "$here/$1" "$here/peers/$1" "$here/../shared/peers/$1" "$here/../../shared/peers/$1"; do
    [ -f "$f" ] && { echo "$f"; return 0; }
  done
  return 1
}
if jax_peers="$(find_peer jax_peers.py)"; then
  stage jax_peers 170 110 "$python" "$jax_peers"
else
  echo "STAGE jax_peers FAILED: jax_peers.py is not in the bundle" | record
  failures+=("jax_peers: missing")
fi
if torch_peers="$(find_peer torch_peers.py)"; then
  stage torch_peers 170 40 "$python" "$torch_peers"
else
  echo "STAGE torch_peers FAILED: torch_peers.py is not in the bundle" | record
  failures+=("torch_peers: missing")
fi

# ---- 4. JAX's peak memory per step --------------------------------------------------------
if [ -n "${jax_peers:-}" ]; then
  stage jax_memory 60 5 "$python" "$here/jax_memory.py" --peers="$jax_peers" --layer=cudnn
fi

# ---- 5. the table ---------------------------------------------------------------------------
say "summary"
summary_args=("$raw")
[ -s "$work/te_bench.json" ] && summary_args+=(--te_bench_json="$work/te_bench.json")
"$python" "$here/summarize.py" "${summary_args[@]}" --out="$work/bench.md"
[ $? -eq 0 ] || failures+=("summarize: failed")
if [ ${#failures[@]} -gt 0 ]; then
  echo
  echo "Stages that did not finish cleanly:"
  printf '  %s\n' "${failures[@]}"
fi
say "done in $(( $(date +%s) - start_s )) s; raw lines in $raw"
[ ${#failures[@]} -eq 0 ]
