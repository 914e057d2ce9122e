#!/usr/bin/env bash
# One measuring cycle on the H200, from the repository root there, over what
# bench/h200_pack.sh put in .gpubundle/ (sent with the device tool's
# carry: [".gpubundle"]). Each stage writes one file to $OUT, so a call
# brings its raw output back; a call has 10 minutes, so give it the stages
# that fit (about: tests 5 min, quickstart 3, lm 6, decode 3, ops 1; on H100s on 2026-12-07:
# tests 179-236 s, quickstart 144-205, lm 281 on one machine and more than 354 on another (tests
# + lm overran a 590 s call there), fp8ratio 175-239, trace 63-114 with three LM variants,
# trace2048 96-155).
#
#   bash bench/h200_cycle.sh tests quickstart ops   # first call
#   bash bench/h200_cycle.sh lm decode              # second call
#
#   tests       every GPU test binary, the GPU fault run at FAULT_SECONDS (30)
#   quickstart  the quickstart's six sections from both clients (the mean of 30 steps
#               after 5: a mean of 10 let one slow step move a Python / C++ ratio) and JAX's
#               plain-Flax layer (bench/layers/compare_quickstarts.sh)
#   lm          the LM of train_lm.py at 4 x 256 and 24 x 1024 (TE's relative
#               bias on and off) and 24 x 2048 (bias off), bf16 and FP8,
#               against jax_lm_peer.py in the same call (bench/lm_bench.py)
#   lmbias      lm's 24 x 1024 rows only (TE's relative bias on and off, bf16 and
#               FP8, and JAX's): the relative bias's cost when a call has no room for lm
#   fp8ratio    lm's 24 x 1024 and 24 x 2048 rows without the bias (bf16, FP8, JAX's):
#               #24's FP8 ratios when a call has no room for lm
#   trace       the 24 x 1024 LM's step by kernel class under the CUPTI
#               tracer: bf16 bias on, bf16 bias off, FP8 bias off
#               (bench/tools/trace_lm.sh), and the quickstart's FP8 and bf16
#               TransformerLayer (layer_bench variants 6 and 7,
#               bench/tools/trace_step.sh); reports in $OUT/trace, the traces
#               themselves in /tmp/trace_raw on the GPU machine
#   trace2048   the 24 x 2048 LM's step the same way, bf16 and FP8 without the
#               bias; reports in $OUT/trace_2048
#   decode      Generate against JAX's jit'd decode loop (bench/decode_bench.py)
#   ops         ops_bench; against .gpubundle's oldlib too when it holds one
#   cast        cast_transpose_bench: the FP8 cast-transpose op against the
#               candidate kernels of bench/kernels/cast_transpose_variants.h
#   bias        relative_bias_bench: each piece TE's relative bias adds to the
#               24 x 1024 LM's attention, timed alone, with its floor
#   engines     cudnn_engine_probe: every cuDNN engine config of the 24 x 1024
#               LM's attention graphs against the one the product takes
#
# Ends with one line per stage: its exit status and seconds.
set -u
root="$(pwd)"
b=/tmp/b
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"  # OUT may name a folder under the call's $OUT
if [ ! -x "$b/run.sh" ]; then
  mkdir -p "$b"
  xz -dc "$root/.gpubundle/gb.tar.xz" | tar -C "$b" -xf -
fi
export TE_CLIENT_STUBS_DIR="$root/.gpubundle/proto"
peers="$root/.gpubundle/peers"
py=python3
$py -c "import grpc, google.protobuf, numpy" 2>/dev/null || py=/opt/torch/.venv/bin/python
summary=()

stage_tests() {
  FAULT_SECONDS="${FAULT_SECONDS:-30}" "$b/run.sh" --gpu-tests
}

stage_quickstart() {
  # compare_quickstarts.sh wants the Python client and the peer inside the bundle.
  mkdir -p "$b/py"
  cp -r "$root/client/python/te_client" "$root/client/python/examples" "$b/py/"
  rm -rf "$b/py/proto"; cp -r "$TE_CLIENT_STUBS_DIR" "$b/py/proto"
  cp "$peers/jax_peers.py" "$b/"
  cp "$root/bench/layers/start_te_server.sh" "$b/"
  OUT="$(mktemp -d)" bash "$root/bench/layers/compare_quickstarts.sh" "$b" 30 5
}

# The LM's rows at SIZES with TE's relative bias BIAS (on, off or both), bf16
# and FP8, and jax_lm_peer.py's in the same call.
lm_rows() {
  $py "$root/bench/lm_bench.py" --server="$b/run.sh te_server" --peer="$peers/jax_lm_peer.py" \
    --sizes="$1" --bias="$2" --recipes=bf16,delayed --steps=20 --warmup=5
}

stage_lm() {
  lm_rows 4x256x4x128x16,24x1024x16x1024x8 on,off
  lm_rows 24x2048x16x1024x8 off
}

stage_lmbias() {
  lm_rows 24x1024x16x1024x8 on,off
}

# FP8 against bf16 where #24 sets its ratios: 24 x 1024 and 24 x 2048, no bias.
stage_fp8ratio() {
  lm_rows 24x1024x16x1024x8,24x2048x16x1024x8 off
}

# The device tool brings back 8 files a call: the reports come back under
# $out/trace, the traces, servers' logs and bench lines stay in TRACE_RAW
# (/tmp/trace_raw) on the GPU machine, for a later call on it to read.
stage_trace() {
  local raw="${TRACE_RAW:-/tmp/trace_raw}"
  rm -rf "$raw"
  PYTHON="$py" bash "$b/trace_lm.sh" "$b" "$raw"
  bash "$b/trace_step.sh" "$raw" 6 7
  mkdir -p "$out/trace"
  cp "$raw"/report_*.txt "$out/trace/"
}

# The 24 x 2048 LM's step by kernel class, bf16 and FP8 without the bias
# (trace_lm.sh at TRACE_SIZE 24 x 2048); reports in $OUT/trace_2048.
stage_trace2048() {
  local raw="${TRACE_RAW:-/tmp/trace_raw}_2048"
  rm -rf "$raw"
  TRACE_SIZE=24x2048x16x1024x8 TRACE_VARIANTS="bf16:off delayed:off" PYTHON="$py" \
    bash "$b/trace_lm.sh" "$b" "$raw"
  mkdir -p "$out/trace_2048"
  cp "$raw"/report_*.txt "$out/trace_2048/"
}

stage_decode() {
  $py "$root/bench/decode_bench.py" --server="$b/run.sh te_server" --device=cuda:0 \
    --recipes=bf16,delayed --peer_param_dtypes=bfloat16 --client_rows --iters 3
}

# A kernel benchmark from the bundle, then again with .gpubundle's oldlib
# (an earlier commit's kernels) when it holds one: new against old in one call.
bench_new_and_old() {
  "$b/run.sh" "$1"
  if ls "$b"/oldlib/*.so >/dev/null 2>&1; then
    echo "=== the same, with .gpubundle/oldlib's kernels"
    # run.sh puts the bundle's own folder first; the old library must come before it.
    LD_LIBRARY_PATH="$b/oldlib:$b:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib" \
      "$b/$1"
  fi
}

stage_bias() {
  bench_new_and_old relative_bias_bench
}

stage_engines() {
  "$b/run.sh" cudnn_engine_probe 2>&1 | grep -v '^te_server:'
}

stage_ops() {
  bench_new_and_old ops_bench
}

stage_cast() {
  "$b/run.sh" cast_transpose_bench
}

for stage in "$@"; do
  if ! declare -F "stage_$stage" >/dev/null; then
    echo "h200_cycle: no stage '$stage' (tests, quickstart, lm, lmbias, fp8ratio, trace, trace2048, decode, ops, cast, bias, engines)" >&2
    exit 2
  fi
done
for stage in "$@"; do
  start=$(date +%s)
  echo "=== $stage ($(date -u +%H:%M:%S))"
  "stage_$stage" >"$out/$stage.txt" 2>&1
  rc=$?
  tail -n 25 "$out/$stage.txt"
  summary+=("$stage: exit $rc, $(( $(date +%s) - start )) s")
done
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >"$out/gpu.txt" 2>&1
printf '%s\n' "${summary[@]}"
