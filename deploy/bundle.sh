#!/usr/bin/env bash
# Builds the server, the quickstart, the GPU tests and the benchmarks, and puts
# them with the shared libraries they need (all but glibc, the C++ runtime and
# CUDA's own, which the GPU host has) into one folder that runs on a GPU host
# with CUDA 13, cuBLASLt and cuDNN 9:
#
#   deploy/bundle.sh [FOLDER]        # default ./bundle (git-ignored)
#   FOLDER/run.sh PROGRAM [ARGS...]  # on the GPU host, e.g. run.sh ops_gpu_test
#   FOLDER/run.sh --gpu-tests        # every *_gpu_test, then a summary line
#
# BUNDLE_TARGETS="//a:b //c:d" replaces the default target list. Binaries are
# stripped; the script fails if the folder exceeds 64 MiB (what the GPU
# machine accepts in one call) unless BUNDLE_ANY_SIZE is set (then compress
# it: tar cJf bundle.tar.xz -C FOLDER ., about a quarter of the size).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-bundle}"
max_bytes=$((64 * 1024 * 1024))

# Targets: the fixed ones, then every test tagged gpu and every binary tagged
# benchmark. Missing ones are skipped with a message.
wanted=(//server:te_server //client:quickstart //bench/tools:libkernel_trace.so)
if [ -n "${BUNDLE_TARGETS:-}" ]; then
  read -r -a wanted <<<"$BUNDLE_TARGETS"
else
  # --keep_going: a package that does not load yet must not hide the others.
  while read -r t; do
    [ -n "$t" ] && wanted+=("$t")
  done < <(bazel query --keep_going --noshow_progress \
             'attr(tags, "\bgpu\b", tests(//...)) + attr(tags, "\bbenchmark\b", kind("cc_binary", //...))' \
             2>/dev/null || true)
fi

targets=()
for t in "${wanted[@]}"; do
  if bazel query --noshow_progress "$t" >/dev/null 2>&1; then
    targets+=("$t")
  else
    echo "bundle: skipping $t (no such target)" >&2
  fi
done
if [ ${#targets[@]} -eq 0 ]; then
  echo "bundle: nothing to build" >&2
  exit 1
fi

echo "bundle: building ${targets[*]}" >&2
# Keep going: one broken target should not stop the rest from shipping.
bazel build --keep_going "${targets[@]}" >&2 || echo "bundle: some targets failed to build (skipped below)" >&2

rm -rf "$out"
mkdir -p "$out"
bin_root="$(bazel info bazel-bin 2>/dev/null)"

# Libraries the GPU host provides itself: glibc, the C++ runtime (the host's is
# newer) and the CUDA toolkit / driver / cuDNN.
system_lib='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread|libdl\.|librt\.|libresolv|libutil|libnsl|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcudnn|libnvrtc|libnvJitLink|libnvidia)'

copied=()
for t in "${targets[@]}"; do
  pkg="${t#//}"; pkg="${pkg%%:*}"; name="${t##*:}"
  src="$bin_root/$pkg/$name"
  if [ ! -x "$src" ]; then
    echo "bundle: skipping $t (not built)" >&2
    continue
  fi
  dest="$out/$name"
  if [ -e "$dest" ]; then dest="$out/${pkg//\//_}_$name"; fi
  cp "$src" "$dest"
  chmod u+w "$dest"
  strip --strip-unneeded "$dest" 2>/dev/null || true
  copied+=("$(basename "$dest")")
  # Non-system libraries, wherever they resolve (system or bazel _solib folders).
  ldd "$src" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r lib path; do
    if [[ "$lib" =~ $system_lib ]]; then continue; fi
    if [ ! -e "$out/$lib" ]; then
      cp -L "$path" "$out/$lib"
      chmod u+w "$out/$lib"
      strip --strip-unneeded "$out/$lib" 2>/dev/null || true
    fi
  done
done

cat >"$out/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs a bundled program with the bundle's libraries, then cuDNN 9.19 (the
# version of the headers it was built with; PyTorch's copy on the GPU machine)
# and CUDA 13's libraries.
here="$(cd "$(dirname "$0")" && pwd)"
cudnn="${TE_CUDNN_DIR:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib}"
cuda="${TE_CUDA_LIB_DIR:-/usr/local/cuda-13.0/targets/x86_64-linux/lib}"
export LD_LIBRARY_PATH="$here:$cudnn:$cuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TE_REQUIRE_GPU=1  # GPU tests fail, not skip, when no GPU is found
# Tests that start a real server (tests/gpu/*fault*) find the bundled one.
[ -x "$here/te_server" ] && export TE_SERVER_BINARY="${TE_SERVER_BINARY:-$here/te_server}"
if [ "${1:-}" = "--gpu-tests" ]; then
  shift
  failed=0; passed=0
  for t in "$here"/*_gpu_test; do
    [ -x "$t" ] || continue
    echo "=== $(basename "$t")"
    if "$t" "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAILED: $(basename "$t")"; fi
  done
  echo "gpu test binaries: $passed passed, $failed failed"
  [ "$failed" -eq 0 ]
  exit
fi
if [ $# -eq 0 ]; then
  echo "usage: run.sh PROGRAM [ARGS...] | run.sh --gpu-tests [GTEST_ARGS...]" >&2
  ls "$here" >&2
  exit 2
fi
program="$1"; shift
case "$program" in */*) ;; *) program="$here/$program" ;; esac
# te_server also takes its flags from the environment, for containers:
# TE_FLAG_DEVICE=cpu is --device=cpu. Command-line flags come after them and
# win.
env_flags=()
if [ "$(basename "$program")" = te_server ]; then
  for name in $(compgen -e); do
    case "$name" in
      TE_FLAG_?*) flag="${name#TE_FLAG_}"; env_flags+=("--${flag,,}=${!name}") ;;
    esac
  done
fi
exec "$program" "${env_flags[@]}" "$@"
EOF
chmod +x "$out/run.sh"

bytes=$(du -sb "$out" | cut -f1)
echo "bundle: $out holds ${copied[*]:-nothing} and $(ls "$out" | grep -c '\.so') libraries: $((bytes / 1024 / 1024)) MiB" >&2
if [ "$bytes" -gt "$max_bytes" ] && [ -z "${BUNDLE_ANY_SIZE:-}" ]; then
  echo "bundle: $out is over 64 MiB; bundle fewer targets with BUNDLE_TARGETS" >&2
  exit 1
fi

# BUNDLE_NO_BENCH=1 (a container image) stops here.
if [ -n "${BUNDLE_NO_BENCH:-}" ]; then
  git rev-parse HEAD >"$out/COMMIT" 2>/dev/null || true
  exit 0
fi

# The GPU benchmark scripts (bench/harness, bench/layers, bench/kernels) and
# the peers they compare against (../shared/peers, or $TE_PEERS_DIR: they are
# outside the repository and do not travel otherwise), and the commit the
# bundle was built from.
cp bench/harness/run_gpu_bench.sh bench/harness/run_multi_client_bench.sh bench/harness/summarize.py \
  bench/harness/jax_memory.py bench/harness/profile_step.sh bench/harness/gemm_sustained.py \
  bench/tools/trace_step.sh bench/tools/trace_decode.sh bench/tools/trace_lm.sh bench/tools/kernel_trace_report.py \
  bench/layers/compare_quickstarts.sh \
  bench/layers/run_train_lm.sh bench/layers/start_te_server.sh bench/layers/train_step_bench.py \
  bench/kernels/run_small_head_attention.sh "$out"/
peers_dir="${TE_PEERS_DIR:-../shared/peers}"
if compgen -G "$peers_dir/*.py" >/dev/null; then
  cp "$peers_dir"/*.py "$out"/
else
  echo "bundle: no peers in $peers_dir (run_gpu_bench.sh will report them missing)" >&2
fi
git rev-parse HEAD >"$out/COMMIT" 2>/dev/null || true
git diff --quiet HEAD 2>/dev/null || echo "(with uncommitted changes)" >>"$out/COMMIT"
