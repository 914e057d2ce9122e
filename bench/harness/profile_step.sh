#!/usr/bin/env bash
# The quickstart TransformerLayer's step explained, in one call on the GPU
# machine, from the bundle folder (deploy/bundle.sh):
#
#   bundle/profile_step.sh [VARIANTS]      # default "6 7" (FP8, bf16); $OUT for files
#
#   1. the GPU's clocks, power and throttle reasons sampled every 100 ms
#      through the whole call (nvidia-smi reads only; $OUT/smi.csv);
#   2. the GEMM ceilings as a long run sees them (gemm_sustained.py: the
#      layer's 12 GEMMs back to back for 4 s, in bf16 and FP8);
#   3. per variant, CUPTI traces after 25 warmup steps, when the clocks have
#      settled (trace_step.sh, reports with --timeline): 5 Benchmark steps
#      each timed alone, 5 queued back to back, and 5 pipelined client calls;
#   4. per variant, layer_bench on a fresh server: the Benchmark RPC's step
#      and the pipelined client's, 4 interleaved rounds (--rounds);
#   5. the peers (torch_peers.py, jax_peers.py) in the same call.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
variants="${1:-6 7}"
out="${OUT:-$(mktemp -d /tmp/te_profile.XXXXXX)}"
mkdir -p "$out"
python="${PYTHON:-python3}"
torch_python="$python"  # the GPU machine's python3 has torch and jax

nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 100 >"$out/smi.csv" 2>/dev/null &
smi=$!
trap 'kill $smi 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv | tee "$out/gpu.txt"

if [ -z "${PROFILE_SKIP_GEMM:-}" ]; then  # PROFILE_SKIP_GEMM=1 leaves stage 2 out
  echo "== sustained GEMM ceilings"
  timeout 120 "$torch_python" "$here/gemm_sustained.py" 4 2>&1 | tee "$out/gemm_sustained.txt"
fi

echo "== traces after 25 warmup steps: the Benchmark's steps timed alone, queued, and the pipelined client's"
TRACE_WARMUP=25 timeout 300 bash "$here/trace_step.sh" "$out/trace" $variants >"$out/trace.txt" 2>&1
TRACE_WARMUP=25 TRACE_BENCH_ARGS="--client_side=false" TRACE_STEPS=1 TRACE_TAG=_queued \
  timeout 300 bash "$here/trace_step.sh" "$out/trace" $variants >>"$out/trace.txt" 2>&1
TRACE_WARMUP=25 TRACE_BENCH_ARGS="--server_side=false --client_depth=2" TRACE_TAG=_client \
  timeout 300 bash "$here/trace_step.sh" "$out/trace" $variants >>"$out/trace.txt" 2>&1
grep -E "^steps|^step wall|^  [a-z]" "$out/trace.txt" | head -80

echo "== layer_bench, interleaved rounds"
for v in $variants; do
  pf=$(mktemp)
  "$here/run.sh" te_server --device=cuda:0 --host=127.0.0.1 --port=0 --port_file="$pf" >"$out/server_bench_v$v.log" 2>&1 &
  spid=$!
  for _ in $(seq 600); do [ -s "$pf" ] && break; sleep 0.1; done
  timeout 300 "$here/run.sh" layer_bench --server="127.0.0.1:$(cat "$pf")" --config=quickstart --variants="$v" \
    --warmup=5 --iters=30 --rounds=4 2>&1 | tee -a "$out/layer_bench.txt" | grep -E "^OURS"
  kill -TERM $spid; wait $spid
done

echo "== peers"
timeout 240 "$torch_python" "$here/torch_peers.py" 2>&1 | tee "$out/torch_peers.txt" | grep -E "CEIL|PEER"
timeout 240 "$python" "$here/jax_peers.py" 2>&1 | tee "$out/jax_peers.txt" | grep -E "PEER"
kill $smi 2>/dev/null
# At most a few files come back from the GPU machine: the traces and logs go in one archive.
(cd "$out" && cat jax_peers.txt >>torch_peers.txt && rm -f jax_peers.txt &&
  tar czf logs.tgz trace trace.txt server_bench_v*.log gpu.txt && rm -rf trace trace.txt server_bench_v*.log gpu.txt)
echo "== the SM clock while the GPU worked (samples over 300 W)"
awk -F', ' '{gsub(/ MHz/,"",$2); gsub(/ W/,"",$4); if ($4 > 300) print $2, ($6 ~ /4$/ ? 1 : 0)}' "$out/smi.csv" |
  sort -n | awk '{c[NR] = $1; capped += $2}
    END {if (NR) printf "sm clock min %s median %s max %s MHz over %d samples; power capped in %d\n", c[1], c[int(NR / 2) + 1], c[NR], NR, capped}'
