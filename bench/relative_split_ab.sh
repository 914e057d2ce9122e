#!/usr/bin/env bash
# The far/band split's kernels, new against old, in one call on the GPU machine, from the
# repository root: .gpubundle/ packed with PACK_TARGETS naming relative_bias_bench and the
# split's GPU tests (relative_band_gpu_test, //tests/gpu:layers_gpu_test, attention_gpu_test)
# and an earlier commit's libkernels_Scuda_Slibkernels.so as its OLD_KERNELS_SO:
#   PACK_TARGETS="..." bash bench/h200_pack.sh OLD.so
# (in one archive with the new library the old one adds about 7 MB; xz'd on its own it added
# 21 and put a call over its 64 MiB with the tree). The old run is the new bundle with that
# library. Runs the tests, both
# benches twice (old, new, old, new), then Nsight Compute on the new kernels (NCU=0 skips it;
# on 2026-12-07's H100 ncu could not reach the CUDA driver).
set -u
root="$(pwd)"; out="${OUT:-/tmp/out}"; mkdir -p "$out"
unpack() { rm -rf "$2"; mkdir -p "$2"; xz -dc "$1/gb.tar.xz" | tar -C "$2" -xf -; }
unpack "$root/.gpubundle" /tmp/b_new
if [ -f /tmp/b_new/oldlib/libkernels_Scuda_Slibkernels.so ]; then
  rm -rf /tmp/b_old; cp -a /tmp/b_new /tmp/b_old
  cp /tmp/b_new/oldlib/libkernels_Scuda_Slibkernels.so /tmp/b_old/
fi
nvidia-smi --query-gpu=name --format=csv,noheader
bash "$root/bench/relative_split_tests.sh" /tmp/b_new "$out" || { echo "a GPU test failed: no timing"; exit 1; }
for round in 1 2; do
  for which in old new; do
    [ -x /tmp/b_$which/run.sh ] || continue
    echo "=== $which ($round)"
    /tmp/b_$which/run.sh relative_bias_bench >"$out/bench_${which}_$round.txt" 2>&1
    grep -E "^\||copy bandwidth|does not|did not" "$out/bench_${which}_$round.txt"
  done
done
[ "${NCU:-1}" = 1 ] || exit 0
ncu --clock-control none --target-processes all --kernel-name regex:'RelativeBandSplitKernel' \
  --launch-count 3 --section SpeedOfLight --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats \
  /tmp/b_new/run.sh relative_bias_bench --reps=1 >"$out/ncu.txt" 2>&1
echo "ncu rc $?"
grep -E "RelativeBand|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Th|Achieved Occupancy|Registers Per|Grid Size|Stall|Warp Cycles Per Issued|Issued Warp|L2 Hit|L1/TEX Hit|No Eligible" "$out/ncu.txt" | head -80
