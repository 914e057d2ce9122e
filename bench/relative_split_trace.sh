#!/usr/bin/env bash
# Where the 24 x 1024 LM's step with TE's relative bias spends its time with the far/band
# split on and off (bench/tools/trace_lm.sh under the CUPTI tracer), from the repository root
# on the GPU machine over what bench/h200_pack.sh put in .gpubundle/ (carry: [".gpubundle"]);
# both arms name the flag, so they trace the same two paths whatever te_server's default.
#
#   bash bench/relative_split_trace.sh [VARIANTS_ON] [VARIANTS_OFF]   # defaults "bf16:on delayed:on", "bf16:on"
set -u
root="$(pwd)"; b=/tmp/b; out="${OUT:-/tmp/out}"; mkdir -p "$out"
if [ ! -x "$b/run.sh" ]; then mkdir -p "$b"; xz -dc "$root/.gpubundle/gb.tar.xz" | tar -C "$b" -xf -; fi
export TE_CLIENT_STUBS_DIR="$root/.gpubundle/proto"
PYTHON=python3; $PYTHON -c "import grpc, google.protobuf, numpy" 2>/dev/null || PYTHON=/opt/torch/.venv/bin/python
export PYTHON TRACE_BY_KERNEL=8
echo "=== split on"
TRACE_VARIANTS="${1:-bf16:on delayed:on}" TRACE_SERVER_FLAGS=--relative_bias_split=true \
  bash bench/tools/trace_lm.sh "$b" "$out/split_on" 2>&1 | grep -v "^  " | head -120
[ -n "${2-x}" ] || exit 0
echo "=== split off"
TRACE_VARIANTS="${2:-bf16:on}" TRACE_SERVER_FLAGS=--relative_bias_split=false \
  bash bench/tools/trace_lm.sh "$b" "$out/split_off" 2>&1 | grep -v "^  " | head -80
