#!/usr/bin/env bash
# Builds te_server's request fuzzer with clang-14 + libFuzzer (outside Bazel:
# one clang++ line over the session layer, the layers, the CPU backend and the
# generated protos, linked against Debian's libraries) under AddressSanitizer
# and UndefinedBehaviorSanitizer, and runs it for FUZZ_SECONDS (default 60)
# from the seed corpus in tests/fuzz/corpus.
#
#   tests/fuzz/run_fuzz.sh            build, then fuzz for FUZZ_SECONDS
#   tests/fuzz/run_fuzz.sh --seeds    rewrite tests/fuzz/corpus from SeedInputs (no fuzzing)
#   tests/fuzz/run_fuzz.sh FILE...    build, then run just these inputs (reproduce a crash)
#
# Environment: FUZZ_SECONDS (60), FUZZ_JOBS (1), FUZZ_BUILD_DIR (/tmp/te_fuzz_build),
# CXX (clang++-14), FUZZ_KEEP_GOING (0; 1: libFuzzer's fork mode with FUZZ_JOBS
# children, which records a crash, timeout or OOM and carries on, so one run
# lists every crash it finds, open ones in the seeds included), FUZZ_ARGS (more
# libFuzzer flags, e.g. "-entropic=0", which about doubles exec/s here). Needs: clang-14 libclang-rt-14-dev libfuzzer-14-dev
# protobuf-compiler and the -dev packages the server builds with.
# A crash leaves crash-<sha1> in FUZZ_BUILD_DIR/artifacts; the script prints
# it. Keep it as tests/fuzz/regressions/<name> with the fix (corpus_test
# replays every file there). Exit status: 0 clean, 1 a crash or a build error.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
build="${FUZZ_BUILD_DIR:-/tmp/te_fuzz_build}"
seconds="${FUZZ_SECONDS:-60}"
jobs="${FUZZ_JOBS:-1}"
cxx="${CXX:-clang++-14}"
mkdir -p "$build/gen" "$build/obj" "$build/artifacts" "$build/corpus"

start=$(date +%s)
# ---- protos ------------------------------------------------------------------
# Into a fresh folder, then copied over only where changed: unchanged protos
# keep their objects.
rm -rf "$build/gen.new" && mkdir -p "$build/gen.new"
protoc --proto_path=proto --cpp_out="$build/gen.new" proto/te/v1/*.proto proto/te/state/v1/*.proto
(cd "$build/gen.new" && find . -type f) | while read -r f; do
  if ! cmp -s "$build/gen.new/$f" "$build/gen/$f"; then
    mkdir -p "$(dirname "$build/gen/$f")" && cp "$build/gen.new/$f" "$build/gen/$f"
  fi
done

# ---- sources: everything the session layer runs on, CPU backend only ----------
sources=(kernels/ops.cc kernels/tensor.cc kernels/op_checks.cc kernels/broadcast.cc kernels/no_cuda_device.cc
         proto/dtype.cc server/security/secrets.cc tests/fuzz/request_harness.cc
         tests/fuzz/seeds.cc)
for f in kernels/cpu/*.cc server/layers/*.cc server/optim/*.cc server/session/*.cc; do
  case "$f" in
    *_test.cc|*testing.cc) ;;
    *) sources+=("$f") ;;
  esac
done
for f in "$build"/gen/te/v1/*.pb.cc "$build"/gen/te/state/v1/*.pb.cc; do sources+=("$f"); done

sanitize=(-fsanitize=address,undefined -fno-sanitize-recover=undefined
          -fno-sanitize=vptr -fno-omit-frame-pointer)
cflags=(-std=c++17 -O1 -g -I. -I"$build/gen" -Wall -Wimplicit-fallthrough
        -Wno-unused-but-set-variable -Wno-deprecated-declarations)
libs=(-lprotobuf -lopenblas -lssl -lcrypto -lpthread -lrt)
for a in base city civil_time cord cord_internal cordz_functions cordz_handle cordz_info \
         debugging_internal demangle_internal exponential_biased graphcycles_internal hash \
         int128 low_level_hash malloc_internal raw_hash_set raw_logging_internal spinlock_wait \
         stacktrace status statusor str_format_internal strerror strings strings_internal \
         symbolize synchronization throw_delegate time time_zone bad_optional_access \
         bad_variant_access; do
  libs+=("-labsl_$a")
done

# Objects are compiled in parallel and kept, so a second run rebuilds only what changed.
objects=()
compile() {  # source object
  "$cxx" "${cflags[@]}" "${sanitize[@]}" "$2" -c "$1" -o "$3"
}
pids=()
for src in "${sources[@]}"; do
  obj="$build/obj/$(echo "$src" | tr '/' '_').o"
  objects+=("$obj")
  if [[ ! -f "$obj" || "$src" -nt "$obj" || "$repo/tests/fuzz/run_fuzz.sh" -nt "$obj" ]]; then
    # Headers are not tracked: a stale object is refreshed by removing $build/obj.
    compile "$src" "-fsanitize=fuzzer-no-link" "$obj" &
    pids+=($!)
    if (( ${#pids[@]} >= $(nproc) )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  fi
done
for pid in "${pids[@]}"; do wait "$pid"; done

"$cxx" "${cflags[@]}" "${sanitize[@]}" -fsanitize=fuzzer tests/fuzz/request_fuzzer.cc \
  "${objects[@]}" "${libs[@]}" -o "$build/request_fuzzer"
"$cxx" "${cflags[@]}" "${sanitize[@]}" tests/fuzz/write_seeds.cc \
  "${objects[@]}" "${libs[@]}" -o "$build/write_seeds"
built=$(date +%s)
echo "run_fuzz: built in $((built - start)) s: $build/request_fuzzer"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
if [[ "${1:-}" == "--seeds" ]]; then
  rm -f tests/fuzz/corpus/*
  "$build/write_seeds" tests/fuzz/corpus
  echo "run_fuzz: wrote $(ls tests/fuzz/corpus | wc -l) seeds to tests/fuzz/corpus"
  exit 0
fi
if (( $# > 0 )); then
  exec "$build/request_fuzzer" "$@"
fi

# New inputs go to $build/corpus (the first directory); the checked-in seeds
# are read, never written. Server log lines (ts=...) go to the log file only.
parallel=()
if [[ "${FUZZ_KEEP_GOING:-0}" == 1 ]]; then
  parallel=(-fork="$jobs" -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1)
elif (( jobs > 1 )); then
  parallel=(-jobs="$jobs" -workers="$jobs")
fi
cd "$build"  # libFuzzer writes fuzz-N.log here in parallel mode
set +e
"$build/request_fuzzer" "$build/corpus" "$repo/tests/fuzz/corpus" "$repo/tests/fuzz/regressions" \
  -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -max_len=8192 \
  -print_final_stats=1 "${parallel[@]}" -artifact_prefix="$build/artifacts/" ${FUZZ_ARGS:-} 2>&1 |
  tee "$build/fuzz.log" | grep -vE '^ts=|^"|Uses: '
status=${PIPESTATUS[0]}
set -e
cd "$repo"
end=$(date +%s)
crashes=$(ls "$build/artifacts" 2>/dev/null | wc -l)
echo "run_fuzz: fuzzed $seconds s (total $((end - start)) s), exit $status, artifacts: $crashes"
if (( status != 0 || crashes > 0 )); then
  ls -l "$build/artifacts"
  echo "run_fuzz: reproduce with: tests/fuzz/run_fuzz.sh $build/artifacts/<file>"
  exit 1
fi
