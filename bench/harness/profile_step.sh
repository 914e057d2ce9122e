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
#   3. per variant, a CUPTI trace of 5 steps after 25 warmup steps, when the
#      clocks have settled (trace_step.sh, report with --timeline);
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

echo "== sustained GEMM ceilings"
timeout 120 "$torch_python" "$here/gemm_sustained.py" 4 2>&1 | tee "$out/gemm_sustained.txt"

echo "== traces after 25 warmup steps"
TRACE_WARMUP=25 timeout 300 bash "$here/trace_step.sh" "$out/trace" $variants 2>&1 | tail -n 400 >"$out/trace.txt"
grep -E "^steps|^step wall|^  [a-z]" "$out/trace.txt" | head -40

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
echo "== clocks (MHz) and power (W) over the call: min / median / max"
awk -F', ' '{gsub(/ MHz/,"",$2); gsub(/ W/,"",$4); print $2, $4}' "$out/smi.csv" | sort -n | awk '
  {c[NR]=$1; p[NR]=$2} END {if (NR) printf "sm clock %s / %s / %s MHz over %d samples\n", c[1], c[int(NR/2)+1], c[NR], NR}'
