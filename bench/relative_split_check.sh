#!/usr/bin/env bash
# The far/band split of TE's relative bias on the GPU, from the repository root there over
# what bench/h200_pack.sh put in .gpubundle/ (carry: [".gpubundle"]): its GPU tests
# (relative_band_gpu_test, layers_gpu_test, attention_gpu_test) and relative_bias_bench's timings
# of the split's pieces, then with `lm` the 24 x 1024
# LM with the bias on (te_server --relative_bias_split, and without it) and off, bf16 and FP8,
# against jax_lm_peer.py in the same call (about 60 s of tests, 250 s of LM).
#
#   bash bench/relative_split_check.sh [lm|quick]   # quick: no peer; the bias off once, on with the split on and off
set -u
root="$(pwd)"; b=/tmp/b; rm -rf "$b"; out="${OUT:-/tmp/out}"; mkdir -p "$out"
mkdir -p "$b"; xz -dc "$root/.gpubundle/gb.tar.xz" | tar -C "$b" -xf -
nvidia-smi --query-gpu=name --format=csv,noheader
bash "$root/bench/relative_split_tests.sh" "$b" "$out" || { echo "a GPU test failed: no LM run"; exit 1; }
"$b/run.sh" relative_bias_bench >"$out/relative_bias_bench.txt" 2>&1
grep -E "^\||copy bandwidth|does not|did not" "$out/relative_bias_bench.txt"
[ "${1:-}" = lm ] || [ "${1:-}" = quick ] || exit 0
export TE_CLIENT_STUBS_DIR="$root/.gpubundle/proto"
py=python3; $py -c "import grpc, google.protobuf, numpy" 2>/dev/null || py=/opt/torch/.venv/bin/python
lm() {  # SPLIT BIAS PEER
  local split=false; [ "$1" = on ] && split=true  # named both ways, whatever the default
  local flags="--session_memory_bytes=$((96 << 30)) --relative_bias_split=$split"
  $py bench/lm_bench.py --server="$b/run.sh te_server" --server_flags="$flags" $3 \
    --sizes=24x1024x16x1024x8 --bias="$2" --recipes=bf16,delayed --steps=20 --warmup=5
}
start=$(date +%s)
if [ "$1" = quick ]; then  # the bias on and off, split on and off, no peer: what a short call has room for
  echo "=== split on"; lm on on,off "--peer=" 2>&1 | tee "$out/lm_split_on.txt" | tail -10
  echo "=== split off"; lm off on "--peer=" 2>&1 | tee "$out/lm_split_off.txt" | tail -6
  echo "lm: $(( $(date +%s) - start )) s"; exit 0
fi
echo "=== split on"; lm on on,off "--peer=$root/.gpubundle/peers/jax_lm_peer.py" 2>&1 | tee "$out/lm_split_on.txt" | tail -14
echo "=== split off (bias on)"; lm off on "--peer=" 2>&1 | tee "$out/lm_split_off.txt" | tail -6
echo "lm: $(( $(date +%s) - start )) s"
