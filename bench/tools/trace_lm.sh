#!/usr/bin/env bash
# trace_lm.sh BUNDLE OUTDIR: where a training step of the LM of train_lm.py
# spends its time on the GPU, by kernel class. Per variant, starts the
# bundle's te_server under the CUPTI tracer (libkernel_trace.so), trains the
# 24 x 1024 LM (seq 1024, batch 8) with bench/lm_bench.py for TRACE_STEPS
# steps after 3 warmup steps, and reports the last TRACE_SPANS steps, each
# from one embedding lookup to the next (kernel_trace_report.py
# --step-starts: the pipelined loop's loss reads synchronise mid-step, so
# spans between synchronisations were half steps): their wall time, the
# device's busy and idle time and the kernel time by class. Run from the
# repository root on the GPU machine, with the Python client's stubs
# generated (TE_CLIENT_STUBS_DIR).
# Environment: TRACE_VARIANTS (default "bf16:on bf16:off delayed:off": recipe
# and TE's relative bias), TRACE_SIZE (24x1024x16x1024x8), TRACE_STEPS (6),
# TRACE_SPANS (4), TRACE_TIMELINE (1: also list the busiest reported step's device work in launch
# order), TRACE_SERVER_FLAGS (more te_server flags, e.g. --relative_bias_split), TRACE_BY_KERNEL (6: each class's costliest kernels listed; every report also lists
# the host calls of the last step's longest idle gap), PYTHON (python3: one
# with grpc and numpy).
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
mkdir -p "$out"
for variant in ${TRACE_VARIANTS:-bf16:on bf16:off delayed:off}; do
  recipe="${variant%%:*}"
  bias="${variant##*:}"
  tag="${recipe}_bias_${bias}"
  pf=$(mktemp)
  CUDA_INJECTION64_PATH="$bundle/libkernel_trace.so" KERNEL_TRACE_OUT="$out/trace_lm_$tag.csv" \
    LD_LIBRARY_PATH="$bundle:${LD_LIBRARY_PATH:-}" "$bundle/run.sh" te_server --device=cuda:0 \
    --host=127.0.0.1 --port=0 --port_file="$pf" --log_level=warning \
    --session_memory_bytes=$((96 << 30)) ${TRACE_SERVER_FLAGS:-} >"$out/server_lm_$tag.log" 2>&1 &
  spid=$!
  for _ in $(seq 600); do [ -s "$pf" ] && break; sleep 0.1; done
  if [ ! -s "$pf" ]; then
    echo "trace_lm: the server did not listen:"; cat "$out/server_lm_$tag.log"; exit 1
  fi
  timeout 300 "${PYTHON:-python3}" bench/lm_bench.py --address="127.0.0.1:$(cat "$pf")" \
    --sizes="${TRACE_SIZE:-24x1024x16x1024x8}" --recipes="$recipe" --bias="$bias" \
    --steps="${TRACE_STEPS:-6}" --warmup=3 --min_seconds=0 --peer= 2>&1 | tee "$out/bench_lm_$tag.txt" | head -3
  kill -TERM "$spid"; wait "$spid"
  echo "=== $tag"
  "${PYTHON:-python3}" "$bundle/kernel_trace_report.py" "$out/trace_lm_$tag.csv" --step-starts EmbedForwardKernel --steps "${TRACE_SPANS:-4}" --by-kernel "${TRACE_BY_KERNEL:-6}" --largest-gap \
    ${TRACE_TIMELINE:+--timeline} | tee "$out/report_lm_$tag.txt"
  gzip -f "$out/trace_lm_$tag.csv"
done
