#!/usr/bin/env bash
# trace_step.sh OUTDIR VARIANT...: per layer_bench variant, a te_server under
# the CUPTI tracer (libkernel_trace.so), layer_bench's Benchmark RPC (5 warmup
# + 5 timed steps) and kernel_trace_report.py over the last 5 steps. Runs from
# a bundle folder (deploy/bundle.sh) holding te_server, layer_bench, run.sh,
# libkernel_trace.so, libcupti.so.13 and kernel_trace_report.py.
# TRACE_WARMUP (default 5) sets the warmup steps: the H200's clocks settle
# over a longer run, so 25 shows the step as a sustained run sees it.
# TRACE_BENCH_ARGS (default "--client_side=false --queued=false": the
# Benchmark's steps, each timed alone) replaces layer_bench's timing flags:
# "--client_side=false" ends with the queued Benchmark, whose 5 steps are one
# span between synchronisations (report it with TRACE_STEPS=1);
# "--server_side=false --client_depth=2" traces the pipelined client's calls
# (each call's value read-back closes its step). TRACE_STEPS (default 5): the
# spans reported. TRACE_TAG names the files (default: none). TRACE_REPORT_ARGS go to the
# report: with steps in flight, another thread's wait for the step before cuts the spans in
# mid-step, so cut them at a kernel each step launches once instead
# ("--step-starts DelayedScalingKernel" for an FP8 layer under DelayedScaling).
here="$(cd "$(dirname "$0")" && pwd)"
out="$1"; shift
mkdir -p "$out"
for v in "$@"; do
  pf=$(mktemp)
  CUDA_INJECTION64_PATH="$here/libkernel_trace.so" KERNEL_TRACE_OUT="$out/trace_v$v${TRACE_TAG:-}.csv" \
    LD_LIBRARY_PATH="$here:${LD_LIBRARY_PATH:-}" "$here/run.sh" te_server --device=cuda:0 --host=127.0.0.1 --port=0 --port_file="$pf" >"$out/server_v$v${TRACE_TAG:-}.log" 2>&1 &
  spid=$!
  for i in $(seq 600); do [ -s "$pf" ] && break; sleep 0.1; done
  port=$(cat "$pf")
  timeout 200 "$here/run.sh" layer_bench --server="127.0.0.1:$port" --config=quickstart --variants=$v --warmup="${TRACE_WARMUP:-5}" --iters=5 ${TRACE_BENCH_ARGS:---client_side=false --queued=false} >"$out/bench_v$v${TRACE_TAG:-}.txt" 2>&1
  cat "$out/bench_v$v${TRACE_TAG:-}.txt" | tail -5
  kill -TERM $spid; wait $spid
  tail -2 "$out/server_v$v${TRACE_TAG:-}.log"
  python3 "$here/kernel_trace_report.py" "$out/trace_v$v${TRACE_TAG:-}.csv" --steps "${TRACE_STEPS:-5}" --by-kernel 6 --timeline ${TRACE_REPORT_ARGS:-} | tee "$out/report_v$v${TRACE_TAG:-}.txt"
  gzip -f "$out/trace_v$v${TRACE_TAG:-}.csv"
done
