#!/usr/bin/env bash
# The soak: te_server under te_bench's mixed load (bench/load/te_bench_soak.h:
# bf16 and FP8 TransformerLayers and the quickstart's Flax graph training with
# AdamW, sessions opening and closing) for SOAK_MINUTES, a line per minute
# (calls, failures, step time p50/p99 per kind, device and host memory), the
# memory slopes after the warm-up; then SIGTERM: every held session saved
# (--state_dir), a new server on the same address and directory restores
# them, and te_bench compares their variables bit for bit (GetVariables).
#
#   bench/soak.sh                                     # 8 min, cuda:0, quickstart sizes
#   SOAK_MINUTES=0.5 SOAK_DEVICE=cpu SOAK_CONFIG=small bench/soak.sh   # the CPU check
#   SOAK_RUN=bundle/run.sh TE_SERVER=te_server TE_BENCH=te_bench bench/soak.sh   # a bundle
#
# Environment: SOAK_MINUTES (8), SOAK_DEVICE (cuda:0), SOAK_CONFIG (quickstart
# | small), SOAK_CHURNERS (2), SOAK_INTERVAL_S (60), SOAK_WARMUP_S (180 on a GPU, else 60),
# SOAK_DIR (a fresh temporary folder), SOAK_RUN (a wrapper such as a
# bundle's run.sh), TE_SERVER / TE_BENCH (default: bazel-bin's),
# SOAK_SERVER_FLAGS (more te_server flags, e.g. --noreplay_decode_steps). Exit 0 when
# no call failed, every held session was saved and came back bit for bit,
# and both servers exited 0.
set -uo pipefail
cd "$(dirname "$0")/.."

minutes="${SOAK_MINUTES:-8}"
device="${SOAK_DEVICE:-cuda:0}"
config="${SOAK_CONFIG:-quickstart}"
churners="${SOAK_CHURNERS:-2}"
interval="${SOAK_INTERVAL_S:-60}"
# On a GPU at the quickstart's sizes the caching allocator's reservation and
# jemalloc's arenas fill over the first three minutes (both H200 soaks of
# 2026-12-03): slopes from there; on the CPU from the first minute.
case "$device" in cuda*) default_warmup=180 ;; *) default_warmup=60 ;; esac
warmup="${SOAK_WARMUP_S:-$default_warmup}"
run=(${SOAK_RUN:-})
server_bin="${TE_SERVER:-bazel-bin/server/te_server}"
bench_bin="${TE_BENCH:-bazel-bin/bench/load/te_bench}"
dir="${SOAK_DIR:-$(mktemp -d /tmp/te_soak.XXXXXX)}"
mkdir -p "$dir/state"
rm -f "$dir/ready" "$dir/port"

server_flags=(--device="$device" --state_dir="$dir/state" --log_level=info
              --session_memory_bytes=$((16 << 30)) --max_sessions=64 ${SOAK_SERVER_FLAGS:-})
fail=0
note() { echo "soak: $*"; }

start_server() {  # $1: port (0: any), $2: log
  "${run[@]}" "$server_bin" "${server_flags[@]}" --port="$1" --port_file="$dir/port" \
    --host=127.0.0.1 >"$2" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 600); do
    [ -s "$dir/port" ] && return 0
    kill -0 "$server_pid" 2>/dev/null || { note "the server exited at start:"; cat "$2"; return 1; }
    sleep 0.1
  done
  note "the server did not listen within 60 s"; return 1
}

stop_server() {  # SIGTERM; the exit status, after at most 120 s
  kill -TERM "$server_pid" 2>/dev/null
  for _ in $(seq 1 1200); do
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.1
  done
  wait "$server_pid"
}

start_server 0 "$dir/server1.log" || exit 1
port="$(cat "$dir/port")"
note "server pid $server_pid on 127.0.0.1:$port, $device, state in $dir/state; $minutes min, $config sizes"

# The driver's view of the GPU, once per interval, beside te_bench's lines.
sampler_pid=""
if [[ "$device" == cuda* ]] && command -v nvidia-smi >/dev/null; then
  ( start=$(date +%s)
    while sleep "$interval"; do
      used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "${device#cuda:}" | head -1)
      echo "$(( $(date +%s) - start )) $used"
    done ) >"$dir/nvidia_smi.txt" &
  sampler_pid=$!
fi

( "${run[@]}" "$bench_bin" --server="127.0.0.1:$port" --device="$device" --config="$config" \
    --soak_minutes="$minutes" --soak_churners="$churners" --soak_interval_s="$interval" \
    --soak_warmup_s="$warmup" --server_pid="$server_pid" --soak_restart_wait_s=240 \
    --soak_ready_file="$dir/ready" --rpc_timeout_s=120 2>&1
  echo $? >"$dir/bench_rc" ) | tee "$dir/te_bench.log" &
bench_pid=$!

# Once te_bench has recorded the held sessions' variables: SIGTERM, and a new
# server on the same port and state directory.
while [ ! -e "$dir/ready" ] && kill -0 "$bench_pid" 2>/dev/null; do sleep 0.5; done
[ -n "$sampler_pid" ] && kill "$sampler_pid" 2>/dev/null
if [ -e "$dir/ready" ]; then
  stop_server; rc=$?
  saved=$(grep -o 'stopped; [0-9]* of [0-9]* sessions saved' "$dir/server1.log" | tail -1)
  note "first server exited $rc: ${saved:-no save line}"
  [ "$rc" -eq 0 ] || fail=1
  if [[ "$saved" =~ ([0-9]+)\ of\ ([0-9]+) ]] && [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[2]}" ] &&
     [ "${BASH_REMATCH[1]}" -gt 0 ]; then :; else fail=1; fi
  rm -f "$dir/port"
  restart_start=$(date +%s%N)
  start_server "$port" "$dir/server2.log" || fail=1
  note "second server pid $server_pid on the same port ($(( ($(date +%s%N) - restart_start) / 1000000 )) ms to listen)"
fi
wait "$bench_pid"
bench_rc=$(cat "$dir/bench_rc" 2>/dev/null || echo 2)
note "te_bench exited $bench_rc"
[ "$bench_rc" -eq 0 ] || fail=1
if kill -0 "$server_pid" 2>/dev/null; then
  stop_server; rc=$?
  note "second server exited $rc"
  [ "$rc" -eq 0 ] || fail=1
fi
grep -h 'state directory read' "$dir/server2.log" 2>/dev/null | tail -1

# The driver's figures: used MiB per interval, and the slope after the warm-up.
if [ -s "$dir/nvidia_smi.txt" ]; then
  echo "nvidia-smi memory.used (s MiB):"; cat "$dir/nvidia_smi.txt"
  awk -v w="$warmup" '$1 > w { n++; x=$1/60; sx+=x; sy+=$2; sxx+=x*x; sxy+=x*$2 }
       END { if (n > 1 && n*sxx-sx*sx > 0) printf "nvidia-smi slope after warm-up: %.2f MiB/min (%d samples)\n", (n*sxy-sx*sy)/(n*sxx-sx*sx), n;
             else print "nvidia-smi slope: too few samples" }' "$dir/nvidia_smi.txt"
fi
if [ "$fail" -eq 0 ]; then note "PASS (logs in $dir)"; else note "FAIL (logs in $dir)"; fi
exit "$fail"
