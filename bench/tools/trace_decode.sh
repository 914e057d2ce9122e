#!/usr/bin/env bash
# trace_decode.sh BUNDLE OUTDIR: where a generated token's time goes on the
# GPU. Starts the bundle's te_server under the CUPTI tracer
# (libkernel_trace.so), runs one Generate of the decode benchmark's LM
# (bench/decode_bench.py: 24 x 1024, prompt 128, bf16, no JAX peer, no
# client rows) and reports the last TRACE_STEPS spans between host
# synchronisations (kernel_trace_report.py). A Generate step's host waits
# once, for its tokens (greedy; the next step already queued), so each span
# is one token: its wall
# time, the device's busy time, the idle gaps and the host calls in them, and
# the kernel time by class. Run from the repository root on the GPU machine,
# with the Python client's stubs generated (TE_CLIENT_STUBS_DIR).
# Environment: TRACE_BATCH (1), TRACE_NEW (64: new tokens), TRACE_STEPS (16),
# TRACE_RECIPE (bf16 | delayed), TRACE_SERVER_FLAGS (more te_server flags, e.g.
# --noreplay_decode_steps: every step launch by launch).
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
mkdir -p "$out"
tag="b${TRACE_BATCH:-1}_${TRACE_RECIPE:-bf16}"
pf=$(mktemp)
CUDA_INJECTION64_PATH="$bundle/libkernel_trace.so" KERNEL_TRACE_OUT="$out/trace_decode_$tag.csv" \
  LD_LIBRARY_PATH="$bundle:${LD_LIBRARY_PATH:-}" "$bundle/run.sh" te_server --device=cuda:0 \
  --host=127.0.0.1 --port=0 --port_file="$pf" --log_level=warning ${TRACE_SERVER_FLAGS:-} >"$out/server_decode_$tag.log" 2>&1 &
spid=$!
for _ in $(seq 600); do [ -s "$pf" ] && break; sleep 0.1; done
if [ ! -s "$pf" ]; then
  echo "trace_decode: the server did not listen:"; cat "$out/server_decode_$tag.log"; exit 1
fi
timeout 300 python3 bench/decode_bench.py --address="127.0.0.1:$(cat "$pf")" \
  --batches="${TRACE_BATCH:-1}" --new="${TRACE_NEW:-64}" --iters=1 --recipes="${TRACE_RECIPE:-bf16}" \
  --peer_param_dtypes='' --no-client_rows 2>&1 | tee "$out/bench_decode_$tag.txt" | tail -8
kill -TERM "$spid"; wait "$spid"
python3 "$bundle/kernel_trace_report.py" "$out/trace_decode_$tag.csv" --steps "${TRACE_STEPS:-16}" \
  --timeline | tee "$out/report_decode_$tag.txt"
gzip -f "$out/trace_decode_$tag.csv"
