#!/usr/bin/env bash
# Packs what one H200 measuring cycle (bench/h200_cycle.sh) needs into the
# git-ignored .gpubundle/, to be sent with the device tool's `carry`:
#
#   bash bench/h200_pack.sh [OLD_KERNELS_SO]
#
#   .gpubundle/gb.tar.xz   deploy/bundle.sh's folder (te_server, the quickstart,
#                          every GPU test, ops_bench, relative_bias_bench, te_bench, the kernel
#                          tracer), xz-compressed: the folder itself is over
#                          the 64 MiB a call carries
#   .gpubundle/proto       the Python client's generated stubs
#   .gpubundle/peers       ../shared/peers (JAX's LM and layer peers)
#   .gpubundle/oldlib      OLD_KERNELS_SO when given: a libkernels_Scuda_Slibkernels.so
#                          of an earlier commit, for ops_bench new against old
#
# PACK_TARGETS (bazel labels) bundles those alone instead of every GPU test
# and tool: with an old library the whole pack is over what a call carries
# beside the tree, so a kernel's new-against-old call packs e.g.
#   PACK_TARGETS="//bench/kernels:ops_bench //kernels/cuda:ops_gpu_test" \
#     bash bench/h200_pack.sh OLD.so
set -euo pipefail
cd "$(dirname "$0")/.."
old_so="${1:-}"
dest=.gpubundle
folder="$(mktemp -d)"
trap 'rm -rf "$folder"' EXIT

if [ -n "${PACK_TARGETS:-}" ]; then
  targets="$PACK_TARGETS"
else
  gpu_tests="$(bazel query --noshow_progress 'attr(tags, "\bgpu\b", tests(//...))' | tr '\n' ' ')"
  targets="//server:te_server //client:quickstart //bench/tools:libkernel_trace.so \
//bench/kernels:ops_bench //bench/kernels:cast_transpose_bench //bench/kernels:relative_bias_bench \
//bench/kernels:cudnn_engine_probe //bench/load:te_bench //bench/layers:layer_bench $gpu_tests"
fi
BUNDLE_ANY_SIZE=1 BUNDLE_TARGETS="$targets" bash deploy/bundle.sh "$folder/b"
if [ -n "$old_so" ]; then
  mkdir -p "$folder/b/oldlib"
  cp "$old_so" "$folder/b/oldlib/"
fi

rm -rf "$dest"
mkdir -p "$dest"
tar -C "$folder/b" -cf - . | xz -T2 -6 --lzma2=dict=128MiB >"$dest/gb.tar.xz"
/usr/bin/python3 client/python/te_client/_stubs.py --out "$dest/proto"
cp -r ../shared/peers "$dest/peers"
chmod -R u+w "$dest/peers"  # shared/ is read-only; the next pack removes this copy
du -sh "$dest"
total=$(du -sb "$dest" | cut -f1)
if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
  echo "h200_pack: $dest is $total bytes; a call carries 64 MiB with the tree" >&2
  exit 1
fi
